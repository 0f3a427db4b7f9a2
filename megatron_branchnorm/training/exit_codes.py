"""The trainer's process exit codes (importable without torch: job scripts, launchers and
the rehearsal read them)."""

DONE = 0
"""Training reached train.max_steps, the time budget, or early stopping."""
BAD_INPUT = 2
"""A config, data, checkpoint or DeepSpeed JSON error, a save_dir held by another run, a full
disk: one line on every rank (the front doors, megatron_branchnorm.cli.run_main)."""
NONFINITE_EXIT_CODE = 3
"""train.max_consecutive_skips consecutive non-finite updates (no save)."""
PEER_LOST_EXIT_CODE = 4
"""A collective failed because another rank, or its node, is gone (or the network between
them failed): one line on each surviving rank, no save; a resubmitted job resumes from
``SAVE_DIR/latest``, in another layout when it gets fewer ranks (docs/design.md §17)."""
OUT_OF_MEMORY_EXIT_CODE = 5
"""The device ran out of memory: one line on that rank naming the stage's plan and the levers
(the other ranks then report it lost, exit 4), no save; not requeued: the same settings would
run out again."""
REQUEUE_EXIT_CODE = 75
"""A signal-triggered checkpoint was written (EX_TEMPFAIL): job scripts requeue on it."""
