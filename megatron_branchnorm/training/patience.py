"""Early stopping on the validation loss (fairseq's ``--patience``): a run stops once the
validation loss has not improved for ``train.patience`` validations in a row.

The state is rebuilt on resume from the ``valid_loss`` rows of ``metrics.jsonl`` up to the
checkpoint's step (:meth:`Patience.restore`), so a preempted and requeued run stops where an
uninterrupted one would.
"""

from __future__ import annotations


class Patience:
    """The best validation loss so far, and how many validations since it improved."""

    def __init__(self, patience: int) -> None:
        self.patience = patience
        self.best: float | None = None
        self.best_step: int | None = None
        self.since_best = 0

    def update(self, step: int, loss: float) -> bool:
        """Record the validation loss of ``step``; True when the run should stop."""
        if self.best is None or loss < self.best:
            self.best, self.best_step, self.since_best = loss, step, 0
        else:
            self.since_best += 1
        return self.patience > 0 and self.since_best >= self.patience

    def restore(self, losses: dict[int, float], up_to: int) -> None:
        """Replay the validation losses of the steps up to ``up_to`` (a resumed checkpoint's
        step: rows a killed run logged after it are not part of this run's history)."""
        for step in sorted(s for s in losses if s <= up_to):
            self.update(step, losses[step])

    def describe(self) -> str:
        return (
            f"no improvement of the validation loss in {self.since_best} validations "
            f"(train.patience={self.patience}; best {self.best:.4f} at step {self.best_step})"
        )
