"""Checkpoint retention for long runs: keep the last K checkpoints and the best N.

A 1000-layer checkpoint is ~52 GB, and a 100k-update run that saves every 2,000 updates
writes 50 of them. With ``train.keep_last=K`` the trainer (rank 0, after every complete save)
removes the other checkpoints, except:

- the one ``latest`` names and the newest complete one (what a resume loads:
  :func:`megatron_branchnorm.formats.checkpoint.resume_tag`), whatever K is;
- with ``train.keep_best=N``, the N best checkpoints by ``train.best_metric``: the lowest
  validation loss at their own step (``valid_loss`` rows of ``metrics.jsonl``; the config
  requires ``eval_interval`` to divide ``save_interval``, so every periodic save is scored),
  or the highest validation BLEU (``valid_bleu.jsonl``, written by the companion process
  ``tools/watch_bleu.py``: only the rows on the dev split, under one scoring, that scored
  the checkpoint now at their step, :func:`megatron_branchnorm.formats.records.validation_bleus`);
  ``best.json`` in the save_dir names them, best first, each with its checkpoint id;
- with ``best_metric=valid_bleu``, every checkpoint newer than the newest one scored: the
  companion has yet to score them, and one of them may be the best;
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

import shutil
from pathlib import Path

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import valid_losses, validation_bleus, write_best

REMOVING_PREFIX = ".removing-"
HIGHER_IS_BETTER = {"valid_loss": False, "valid_bleu": True}
"""train.best_metric: whether a higher score is better."""


def checkpoint_ids(save_dir: Path, complete: list[str]) -> dict[str, str]:
    """{tag: checkpoint id} of the complete checkpoints (one removed meanwhile is left out)."""
    ids = {}
    for tag in complete:
        try:
            ids[tag] = ckpt.checkpoint_id(save_dir / tag)
        except FileNotFoundError:
            continue
    return ids


def read_scores(save_dir: Path, metric: str, ids: dict[str, str]) -> dict[int, float]:
    """The scores by step that rank the checkpoints: the validation loss at each step, or
    the validation BLEU of the checkpoints now on disk (``ids``: {tag: checkpoint id})."""
    if metric == "valid_bleu":
        return validation_bleus(save_dir, {ckpt.tag_step(t): i for t, i in ids.items()})
    return valid_losses(save_dir)


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
    complete: list[str], scores: dict[int, float], n: int, higher_is_better: bool = False
) -> list[tuple[str, float]]:
    """The ``n`` complete checkpoints with the best score at their step (the lowest, or the
    highest with ``higher_is_better``), best first (ties: the earlier step)."""
    sign = -1.0 if higher_is_better else 1.0
    scored = [(sign * scores[s], s, t) for t in complete if (s := ckpt.tag_step(t)) in scores]
    return [(t, sign * v) for v, _, t in sorted(scored)[:n]]


def awaiting_scores(complete: list[str], scores: dict[int, float]) -> list[str]:
    """The complete checkpoints newer than the newest scored one (all when none is scored)."""
    newest = max(scores, default=-1)
    return [t for t in complete if (ckpt.tag_step(t) or 0) > newest]


def apply_retention(
    save_dir: Path, keep_last: int, keep_best: int, metric: str = "valid_loss"
) -> tuple[list[str], str]:
    """Remove what :func:`checkpoints_to_remove` says and write ``best.json``; returns the
    removed tags and one line for the log. OSErrors propagate (the caller warns)."""
    for leftover in save_dir.glob(REMOVING_PREFIX + "*"):
        shutil.rmtree(leftover, ignore_errors=True)
    complete, incomplete = ckpt.checkpoint_tags(save_dir)
    ids = checkpoint_ids(save_dir, complete) if keep_best else {}
    scores = read_scores(save_dir, metric, ids) if keep_best else {}
    best = best_checkpoints(complete, scores, keep_best, HIGHER_IS_BETTER[metric])
    waiting = awaiting_scores(complete, scores) if keep_best and metric == "valid_bleu" else []
    if keep_best:
        write_best(save_dir, metric, best, ids)
    latest = ckpt.read_latest(save_dir)
    keep = [t for t, _ in best] + waiting
    doomed = checkpoints_to_remove(complete, incomplete, latest, keep_last, keep)
    for tag in doomed:
        parking = save_dir / f"{REMOVING_PREFIX}{tag}"
        (save_dir / tag).rename(parking)
        shutil.rmtree(parking)
    best_text = ", ".join(f"{t} ({v:.4f})" for t, v in best) or "none scored yet"
    line = (
        f"retention (keep_last={keep_last}, keep_best={keep_best}): removed "
        f"{', '.join(doomed) or 'nothing'}; best by {metric}: {best_text}"
    )
    if len(waiting) > keep_last > 0:
        line += (
            f"; {len(waiting)} checkpoints await their validation BLEU (is tools/watch_bleu.py "
            "running?)"
        )
    return doomed, line
