"""The training loop and its parts (docs/design.md §9). Each part owns one concern and
decides for itself when it is due; :class:`trainer.Trainer` only calls them.

- ``trainer``: the Trainer (build, resume, the loop) and ``run``;
- ``environment``: rank/world from the launcher or SLURM, threads, the process group;
- ``ds_config``: the DeepSpeed JSON, checked and completed; the precision checks;
- ``data``: the vocabulary's identity, the training stream, each update's micro-batches;
- ``checkpointer``: save, retention, resume (same or another stage layout);
- ``validation``: validation loss every eval_interval, early stopping;
- ``metrics``: ``metrics.jsonl`` (its one writer and one reader), console, TensorBoard;
- ``stopping``: signals, the time budget, errors of one rank, non-finite updates;
- ``cuda_graphs``: the stage's layer stack as CUDA graphs per bucket shape, or eager;
- ``grad_norm``: the all-stage gradient norm and the skip of non-finite updates (fp32);
- ``state``: the training position (step, samples) that a checkpoint saves and restores;
- ``stop_signals``: SIGUSR1/SIGTERM/SIGINT and the launcher watch, installed first of all;
- ``exit_codes``: the process exit codes (no torch import).

Only ``metrics``, ``stop_signals`` and ``exit_codes`` can be imported without torch.
"""
