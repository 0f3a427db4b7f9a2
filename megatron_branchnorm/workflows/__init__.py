"""The workflows: long jobs that chain the package's steps and other commands, each in one
module holding both the job and its command line (``main(argv=None) -> int``, through
``cli.run_main``).

A *command* (``megatron_branchnorm.commands``) does one thing to its inputs: parse, build, run
(preprocess, convert, translate, ...). A *workflow* runs a whole job end to end, usually as
subprocesses of those commands and of the trainer, checks what came out and reports it:

- ``demo``: the main job on the built-in corpus, corpus to BLEU report (``tools/run_demo.py``,
  ``mbn-demo``, ``make demo``);
- ``rehearse``: a config at its real depth and topology, width shrunk, on gloo ranks on this
  machine: parity, exact resume, another topology, export (``tools/rehearse.py``,
  ``mbn-rehearse``);
- ``gpu_check``: precision, throughput and parity on a CUDA machine, one table
  (``tools/gpu_check.py``, ``mbn-gpu-check``);
- ``local_slurm``: a real SLURM cluster of K nodes on this host (``tools/local_slurm.py``);
- ``rehearse_slurm``: a shipped sbatch launcher on that cluster, signalled, requeued and resumed
  (``tools/rehearse_slurm.py``).
- ``rehearse_node_loss``: a node of a launcher's job lost, the job resumed on one node fewer
  (``tools/rehearse_node_loss.py``).

Workflows sit above the research harness (``experiments``) and below ``commands`` in the import
graph (docs/design.md §9); a part a workflow shares with the harness lives lower down
(``runner/steps.py``, ``runner/launch.py``).
"""
