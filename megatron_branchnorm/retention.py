"""Checkpoint retention for long runs: keep the last K checkpoints and the best N.

A 1000-layer checkpoint is ~52 GB, and a 100k-update run that saves every 2,000 updates
writes 50 of them. With ``train.keep_last=K`` the trainer (rank 0, after every complete save)
removes the other checkpoints, except:

- the one ``latest`` names and the newest complete one (what a resume loads:
  :func:`megatron_branchnorm.checkpoint.resume_tag`), whatever K is;
- with ``train.keep_best=N``, the N checkpoints with the lowest validation loss at their own
  step (``valid_loss`` rows of ``metrics.jsonl``; the config requires ``eval_interval`` to
  divide ``save_interval``, so every periodic save is scored); ``best.json`` in the save_dir
  names them, best first;
- an incomplete checkpoint (no manifest) newer than ``latest``: none exists while the trainer
  runs (one run per save_dir, saves are synchronous), but a save in progress is never touched.

Incomplete checkpoints older than ``latest`` are the remains of killed saves and are removed.
Everything is decided from what is on disk (the checkpoint directories, ``latest`` and
``metrics.jsonl``), so retention after a preemption and resume is the same as without one.
A checkpoint is first renamed out of the ``global_stepN`` namespace, then deleted: a kill in
the middle leaves a ``.removing-global_stepN`` directory (removed by the next pass), never a
half-deleted checkpoint that still looks complete.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from megatron_branchnorm import checkpoint as ckpt
from megatron_branchnorm.training.metrics import valid_losses

BEST_FILE = "best.json"
REMOVING_PREFIX = ".removing-"


def checkpoints_to_remove(
    complete: list[str],
    incomplete: list[str],
    latest: str | None,
    keep_last: int,
    best: list[str],
) -> list[str]:
    """The tags to remove (see the module docstring); ``complete`` and ``incomplete`` sorted
    by step, ``best`` the tags to keep for their validation loss. ``keep_last`` 0 keeps all."""
    if keep_last <= 0:
        return []
    keep = set(complete[-keep_last:]) | set(best)
    if latest is not None:
        keep.add(latest)
    if complete:
        keep.add(complete[-1])
    newest = max((ckpt.tag_step(t) or 0 for t in keep), default=0)
    stale = [t for t in incomplete if (ckpt.tag_step(t) or 0) < newest]
    return [t for t in complete if t not in keep] + stale


def best_checkpoints(
    complete: list[str], losses: dict[int, float], n: int
) -> list[tuple[str, float]]:
    """The ``n`` complete checkpoints with the lowest validation loss at their step, best
    first (ties: the earlier step)."""
    scored = [(losses[s], s, t) for t in complete if (s := ckpt.tag_step(t)) in losses]
    return [(t, loss) for loss, _, t in sorted(scored)[:n]]


def apply_retention(save_dir: Path, keep_last: int, keep_best: int) -> tuple[list[str], str]:
    """Remove what :func:`checkpoints_to_remove` says and write ``best.json``; returns the
    removed tags and one line for the log. OSErrors propagate (the caller warns)."""
    for leftover in save_dir.glob(REMOVING_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete, incomplete = ckpt.checkpoint_tags(save_dir)
    best = best_checkpoints(complete, valid_losses(save_dir), keep_best) if keep_best else []
    if keep_best:
        record = {
            "metric": "valid_loss",
            "checkpoints": [{"tag": t, "valid_loss": v} for t, v in best],
        }
        tmp = save_dir / f".{BEST_FILE}.tmp"
        tmp.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
        tmp.replace(save_dir / BEST_FILE)
    latest = ckpt.read_latest(save_dir)
    doomed = checkpoints_to_remove(complete, incomplete, latest, keep_last, [t for t, _ in best])
    for tag in doomed:
        parking = save_dir / f"{REMOVING_PREFIX}{tag}"
        (save_dir / tag).rename(parking)
        shutil.rmtree(parking)
    best_text = ", ".join(f"{t} ({v:.4f})" for t, v in best) or "none scored yet"
    line = (
        f"retention (keep_last={keep_last}, keep_best={keep_best}): removed "
        f"{', '.join(doomed) or 'nothing'}; best by valid_loss: {best_text}"
    )
    return doomed, line
