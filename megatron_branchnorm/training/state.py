"""Where a run stands: the one record of the training position, owned by the Trainer, which
the Checkpointer writes into a save and sets from a resume."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    """The training position. ``step``: applied updates (the LR schedule, BranchNorm's t and
    the logged ``step`` follow it; a skipped update does not count); ``samples``: sentence
    pairs drawn so far, skipped updates' included. The data stream's own position is the
    stream's state, saved beside it."""

    step: int = 0
    samples: int = 0
