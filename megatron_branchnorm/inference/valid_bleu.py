"""Validation BLEU during training, from a companion process (docs/design.md §8).

The trainer never generates: at 1000 layers a pipeline has no decoding path, and beam search
inside the training job would hold every stage idle while one rank translates. Instead a
second process (``tools/watch_bleu.py``, a CPU or GPU job beside the training job) watches
the run's save_dir and scores each complete checkpoint once:

1. the checkpoint is read as the converter reads it (checksums verified, fp32 master weights
   where training was bf16) into the flat model, with the checkpoint's own SentencePiece model;
2. the first ``max_sentences`` of every direction of the dev split are translated by beam
   search and scored with the chosen BLEU (sacreBLEU, or the tokenized BLEU of the WMT papers);
3. one row is appended to ``save_dir/valid_bleu.jsonl`` (this process is its only writer, as
   the trainer is the only writer of ``metrics.jsonl``) and ``valid_bleu`` goes to TensorBoard
   under ``save_dir/tensorboard/valid_bleu`` (beside the trainer's curves). The row:

       {"step", "tag", "checkpoint_id", "scoring": {"split", "sentences", "references_sha256",
        "directions", "beam", "lenpen", "max_len_a", "max_len_b", "bleu", "tokenize",
        "lowercase", "compound_split"}, "valid_bleu", "directions" (BLEU of each), "chrf",
        "signature", "split", "sentences", "seconds"}

``valid_bleu`` is the average over the scored directions (the paper's "all" average). A score
is keyed by what was scored (:func:`megatron_branchnorm.formats.records.bleu_row_key`): the
checkpoint's identity (``checkpoint_id``: the SHA-256 of its ``checksums.json``, so a tag that
a rollback rewrote is another checkpoint) and ``scoring`` (the split, the number of sentences,
a fingerprint of the sources and references scored, and every option that changes the
score). The companion skips a checkpoint only when a row with the same key exists: a
restarted companion scores only what is missing, a run with ``--split test`` or other options
scores every checkpoint again under its own key, and a rewritten tag is scored again. A
checkpoint that retention removed before it was scored is skipped with a line.

With ``train.best_metric=valid_bleu`` retention keeps the best checkpoints by the rows that
rank (:func:`megatron_branchnorm.formats.records.validation_bleus`: the dev split, one
scoring, the checkpoint now on disk), and keeps every checkpoint newer than the newest scored
one until it is scored.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import train_config
from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.formats.records import (
    BLEU_FILE,
    append_bleu_row,
    bleu_row_key,
    bleu_scored_keys,
    metrics_path,
    read_metrics,
)
from megatron_branchnorm.inference.convert import (
    ConvertError,
    checkpoint_vocabulary,
    load_pipeline_checkpoint,
)
from megatron_branchnorm.inference.evaluate import (
    DirectionData,
    Scoring,
    evaluate,
    pivot_language,
    read_lines,
    references_from_manifest,
    select_directions,
)
from megatron_branchnorm.inference.translate import SearchOptions


@dataclass
class WatchOptions:
    """What the companion scores and how."""

    data: str | None = None  # DATA_DIR; None: the checkpoint's data.dataset
    split: str = "dev"
    max_sentences: int = 200  # per direction
    directions: list[str] | None = None  # None: every direction of the split
    beam: int = 4
    scoring: Scoring = field(default_factory=Scoring)
    device: str = "cpu"


@dataclass
class Pending:
    """A complete checkpoint to score, and the key its row will carry."""

    tag: str
    checkpoint_id: str
    data: str
    directions: list[DirectionData]
    scoring: dict[str, Any]


def checkpoint_data(save_dir: Path, tag: str, opts: WatchOptions) -> str:
    """The DATA_DIR whose split is scored: ``opts.data``, else the checkpoint's
    ``data.dataset``."""
    if opts.data:
        return opts.data
    ckpt.check_listing(save_dir / tag)  # no file of the tag is read before
    data = train_config.read_train_record(save_dir / tag).config_value("data.dataset")
    if not isinstance(data, str) or not data or data == "synthetic":
        raise ConvertError(f"{save_dir / tag}: trained on synthetic data: no text to translate")
    return data


def scoring_of(data: str, opts: WatchOptions) -> tuple[list[DirectionData], dict[str, Any]]:
    """(the directions to score, the ``scoring`` object of their rows): the split, the number
    of sentences, the SHA-256 of the sources and references that will be scored (so another
    DATA_DIR, or one preprocessed again, is another scoring), and every option that changes
    the score."""
    directions = select_directions(references_from_manifest(data, opts.split), opts.directions)
    digest = hashlib.sha256()
    for d in directions:
        sources = read_lines(d.src_path)[: opts.max_sentences]
        refs = read_lines(d.ref_path)[: opts.max_sentences]
        digest.update(json.dumps([d.name, sources, refs]).encode("utf-8"))
    search = SearchOptions(beam=opts.beam)
    return directions, {
        "split": opts.split,
        "sentences": opts.max_sentences,
        "references_sha256": digest.hexdigest(),
        "directions": [d.name for d in directions],
        "beam": search.beam,
        "lenpen": search.lenpen,
        "max_len_a": search.max_len_a,
        "max_len_b": search.max_len_b,
        "bleu": opts.scoring.bleu,
        "tokenize": opts.scoring.tokenize,
        "lowercase": opts.scoring.lowercase,
        "compound_split": opts.scoring.compound_split,
    }


def pending_checkpoints(save_dir: Path, opts: WatchOptions) -> list[Pending]:
    """The complete checkpoints without a row of the same key (this checkpoint, scored this
    way) in ``valid_bleu.jsonl``, oldest first; one removed meanwhile is left out."""
    complete, _ = ckpt.checkpoint_tags(save_dir)
    scored = bleu_scored_keys(save_dir)
    by_data: dict[str, tuple[list[DirectionData], dict[str, Any]]] = {}
    out = []
    for tag in complete:
        try:
            checkpoint = ckpt.checkpoint_id(save_dir / tag)
            data = checkpoint_data(save_dir, tag, opts)
        except (FileNotFoundError, UserError):
            if (save_dir / tag / ckpt.MANIFEST).is_file():
                raise
            continue  # removed by retention since it was listed
        if data not in by_data:
            by_data[data] = scoring_of(data, opts)
        directions, scoring = by_data[data]
        if bleu_row_key({"checkpoint_id": checkpoint, "scoring": scoring}) not in scored:
            out.append(Pending(tag, checkpoint, data, directions, scoring))
    return out


def unscored_tags(save_dir: Path, opts: WatchOptions) -> list[str]:
    """The tags of :func:`pending_checkpoints`, oldest first."""
    return [p.tag for p in pending_checkpoints(save_dir, opts)]


def run_finished(save_dir: Path) -> bool:
    """Whether training is over: a complete checkpoint at the run's train.max_steps, or an
    early stop recorded in metrics.jsonl (a time budget's end is not known from disk)."""
    if any(r.get("early_stop") for r in read_metrics(save_dir)):
        return True
    complete, _ = ckpt.checkpoint_tags(save_dir)
    if not complete:
        return False
    ckpt.check_listing(save_dir / complete[-1])  # no file of the tag is read before
    record = train_config.read_train_record(save_dir / complete[-1])
    return ckpt.tag_step(complete[-1]) == record.config_value("train.max_steps")


def score_checkpoint(save_dir: Path, pending: Pending, opts: WatchOptions) -> dict[str, Any]:
    """Translate and score the split with checkpoint ``pending.tag``; the row for
    ``valid_bleu.jsonl``, keyed by ``pending``'s checkpoint id and scoring."""
    import sentencepiece as spm

    from megatron_branchnorm.inference.translate import Translator

    start = time.time()
    tag = pending.tag
    model, _ = load_pipeline_checkpoint(save_dir, tag)
    vocab = checkpoint_vocabulary(save_dir, [tag])
    if vocab.spm_path is None:
        raise ConvertError(f"{save_dir / tag}: trained on synthetic data: no text to translate")
    sp = spm.SentencePieceProcessor(model_file=str(vocab.spm_path))
    translator = Translator(model.to(opts.device), sp)
    report = evaluate(
        translator,
        pending.directions,
        SearchOptions(beam=opts.beam),
        opts.scoring.lowercase,
        None,
        opts.max_sentences,
        pivot_language(pending.data),
        None,
        opts.scoring,
    )
    bleus = {name: r["bleu"] for name, r in report["directions"].items()}
    return {
        "step": ckpt.tag_step(tag),
        "tag": tag,
        "checkpoint_id": pending.checkpoint_id,
        "scoring": pending.scoring,
        "valid_bleu": sum(bleus.values()) / len(bleus),
        "directions": bleus,
        "chrf": {name: r["chrf"] for name, r in report["directions"].items()},
        "signature": next(iter(report["directions"].values()))["signature"],
        "split": opts.split,
        "sentences": opts.max_sentences,
        "seconds": round(time.time() - start, 1),
    }


class BleuLog:
    """Appends rows to ``save_dir/valid_bleu.jsonl`` and TensorBoard."""

    def __init__(self, save_dir: Path) -> None:
        self.save_dir = Path(save_dir)
        self.path = metrics_path(save_dir, BLEU_FILE)
        self.tb_dir = Path(save_dir) / "tensorboard" / "valid_bleu"
        self.tb: Any = None

    def write(self, row: dict[str, Any]) -> None:
        append_bleu_row(self.save_dir, row)
        try:
            if self.tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.tb_dir))
            self.tb.add_scalar("valid_bleu", row["valid_bleu"], row["step"])
            self.tb.flush()
        except Exception as exc:  # noqa: BLE001 - TensorBoard must not stop the scoring
            print(f"warning: tensorboard disabled: {one_line(str(exc), 300)}", file=sys.stderr)
            self.tb = False

    def close(self) -> None:
        if self.tb:
            self.tb.close()


def watch(
    save_dir: Path,
    opts: WatchOptions,
    follow: bool = False,
    poll_s: float = 60.0,
    log: Callable[[str], None] = print,
) -> int:
    """Score every checkpoint of ``save_dir`` without a row of the same key (oldest first);
    with ``follow``, keep polling every ``poll_s`` seconds until the run is finished and all
    its checkpoints are scored. Returns the number of checkpoints scored."""
    out = BleuLog(save_dir)
    scored = 0
    try:
        while True:
            for pending in pending_checkpoints(save_dir, opts):
                tag = pending.tag
                try:
                    row = score_checkpoint(save_dir, pending, opts)
                    same = ckpt.checkpoint_id(save_dir / tag) == pending.checkpoint_id
                except (OSError, ValueError, UserError):  # ConvertError, CheckpointError, ...
                    if (save_dir / tag / ckpt.MANIFEST).is_file():
                        raise
                    log(f"{save_dir / tag}: removed before it was scored (retention): skipped")
                    continue
                if not same:  # rewritten while scored: the next pass scores what is there now
                    log(f"{save_dir / tag}: rewritten while it was scored: not recorded")
                    continue
                out.write(row)
                scored += 1
                log(
                    f"{tag}: valid BLEU {row['valid_bleu']:.2f} over {len(row['directions'])} "
                    f"direction(s), {row['seconds']:.0f}s ({row['signature']})"
                )
            if not follow or (run_finished(save_dir) and not pending_checkpoints(save_dir, opts)):
                return scored
            time.sleep(poll_s)
    finally:
        out.close()
