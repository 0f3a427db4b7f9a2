"""The trainer's process exit codes (importable without torch: job scripts, launchers and
the rehearsal read them)."""

DONE = 0
"""Training reached train.max_steps, the time budget, or early stopping."""
BAD_INPUT = 2
"""A config, data, checkpoint or DeepSpeed JSON error, a save_dir held by another run, a full
disk: one line on every rank (megatron_branchnorm.cli.run_main)."""
NONFINITE_EXIT_CODE = 3
"""train.max_consecutive_skips consecutive non-finite updates (no save)."""
REQUEUE_EXIT_CODE = 75
"""A signal-triggered checkpoint was written (EX_TEMPFAIL): job scripts requeue on it."""
