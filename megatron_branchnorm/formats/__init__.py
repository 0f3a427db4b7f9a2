"""The on-disk formats, one owner each, at the bottom of the house (docs/design.md §9).

These modules import only ``megatron_branchnorm.errors``, each other, the standard library and
torch (never DeepSpeed, nor any other floor of the package):

- ``checkpoint``: a save_dir's checkpoints: tag names (``global_stepN``), ``latest``, the
  file names of a tag (DeepSpeed's layer, engine and optimizer files; our RNG states,
  ``train_config.json``, ``spm.model``, ``checksums.json``), checksums, resume's choice of tag,
  the check before a checkpoint is read, safe torch-file loading, RNG states;
- ``train_config``: ``train_config.json``'s typed record (``TrainConfigRecord``: the one
  reader and writer of its keys) and what is derived from it (saved layout, micro-batches);
- ``checkpoint_state``: reading a checkpoint's weights and optimizer state (layer files, bf16
  fp32 master weights through a stand-in for DeepSpeed's pickled ``fragment_address``, Adam's
  state per parameter);
- ``records``: a run's records: the one tolerant reader of ``metrics.jsonl`` and
  ``valid_bleu.jsonl`` (and the writer of the latter's rows), ``best.json``;
- ``data_dir``: a preprocessed DATA_DIR's ``manifest.json``, read into a typed object, and the
  rule for its ``spm_model``.
- ``dirs``: the kinds of directory the tools write (a run, a DATA_DIR, an export, ...): the
  marker, how each kind is recognised, the entries each owns, and the checks before a tool
  replaces one (``check_replaceable``) or the trainer starts in one (``check_run_dir``).
"""
