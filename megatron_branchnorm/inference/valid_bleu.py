"""Validation BLEU during training, from a companion process (docs/design.md §8).

The trainer never generates: at 1000 layers a pipeline has no decoding path, and beam search
inside the training job would hold every stage idle while one rank translates. Instead a
second process (``tools/watch_bleu.py``, a CPU or GPU job beside the training job) watches
the run's save_dir and scores each complete checkpoint once:

1. the checkpoint is read as the converter reads it (checksums verified, fp32 master weights
   where training was bf16) into the flat model, with the checkpoint's own SentencePiece model;
2. the first ``max_sentences`` of every direction of the dev split are translated by beam
   search and scored with the chosen BLEU (sacreBLEU, or the tokenized BLEU of the WMT papers);
3. one row ``{"step", "tag", "valid_bleu", "directions" (BLEU of each), "chrf", "signature",
   ...}`` is appended to
   ``save_dir/valid_bleu.jsonl`` (this process is its only writer, as the trainer is the only
   writer of ``metrics.jsonl``) and ``valid_bleu`` goes to TensorBoard under
   ``save_dir/tensorboard/valid_bleu`` (beside the trainer's curves).

``valid_bleu`` is the average over the scored directions (the paper's "all" average). With
``train.best_metric=valid_bleu`` retention keeps the best checkpoints by it, and keeps every
checkpoint newer than the newest scored one until it is scored. A checkpoint that retention
removed before it was scored is skipped with a line; rows are keyed by step, so a restarted
companion scores only what is missing.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_branchnorm import checkpoint as ckpt
from megatron_branchnorm.inference.convert import (
    ConvertError,
    checkpoint_vocabulary,
    load_pipeline_checkpoint,
    read_train_config,
)
from megatron_branchnorm.inference.evaluate import (
    Scoring,
    evaluate,
    pivot_language,
    references_from_manifest,
    select_directions,
)
from megatron_branchnorm.training.metrics import BLEU_FILE, metrics_path, read_metrics, valid_bleus


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


def unscored_tags(save_dir: Path) -> list[str]:
    """The complete checkpoints without a row in ``valid_bleu.jsonl``, oldest first."""
    complete, _ = ckpt.checkpoint_tags(save_dir)
    scored = valid_bleus(save_dir)
    return [t for t in complete if ckpt.tag_step(t) not in scored]


def run_finished(save_dir: Path) -> bool:
    """Whether training is over: a complete checkpoint at the run's train.max_steps, or an
    early stop recorded in metrics.jsonl (a time budget's end is not known from disk)."""
    if any(r.get("early_stop") for r in read_metrics(save_dir)):
        return True
    complete, _ = ckpt.checkpoint_tags(save_dir)
    if not complete:
        return False
    config = read_train_config(save_dir / complete[-1]).get("config", {})
    return ckpt.tag_step(complete[-1]) == config.get("train", {}).get("max_steps")


def score_checkpoint(save_dir: Path, tag: str, opts: WatchOptions) -> dict[str, Any]:
    """Translate and score the dev split with checkpoint ``tag``; the row for
    ``valid_bleu.jsonl``."""
    import sentencepiece as spm

    from megatron_branchnorm.inference.translate import SearchOptions, Translator

    start = time.time()
    model, meta = load_pipeline_checkpoint(save_dir, tag)
    vocab = checkpoint_vocabulary(save_dir, [tag])
    if vocab.spm_path is None:
        raise ConvertError(f"{save_dir / tag}: trained on synthetic data: no text to translate")
    sp = spm.SentencePieceProcessor(model_file=str(vocab.spm_path))
    translator = Translator(model.to(opts.device), sp)
    data = opts.data or meta["data"]
    directions = select_directions(references_from_manifest(data, opts.split), opts.directions)
    report = evaluate(
        translator,
        directions,
        SearchOptions(beam=opts.beam),
        opts.scoring.lowercase,
        None,
        opts.max_sentences,
        pivot_language(data),
        None,
        opts.scoring,
    )
    bleus = {name: r["bleu"] for name, r in report["directions"].items()}
    return {
        "step": ckpt.tag_step(tag),
        "tag": tag,
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
        self.path = metrics_path(save_dir, BLEU_FILE)
        self.tb_dir = Path(save_dir) / "tensorboard" / "valid_bleu"
        self.tb: Any = None

    def write(self, row: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(row) + "\n")
        try:
            if self.tb is None:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.tb_dir))
            self.tb.add_scalar("valid_bleu", row["valid_bleu"], row["step"])
            self.tb.flush()
        except Exception:  # noqa: BLE001 - TensorBoard must not stop the scoring
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
    """Score every unscored checkpoint of ``save_dir`` (oldest first); with ``follow``, keep
    polling every ``poll_s`` seconds until the run is finished and all its checkpoints are
    scored. Returns the number of checkpoints scored."""
    out = BleuLog(save_dir)
    scored = 0
    try:
        while True:
            for tag in unscored_tags(save_dir):
                try:
                    row = score_checkpoint(save_dir, tag, opts)
                except (OSError, ValueError):  # ConvertError, CheckpointError are ValueErrors
                    if (save_dir / tag / ckpt.MANIFEST).is_file():
                        raise
                    log(f"{save_dir / tag}: removed before it was scored (retention): skipped")
                    continue
                out.write(row)
                scored += 1
                log(
                    f"{tag}: valid BLEU {row['valid_bleu']:.2f} over {len(row['directions'])} "
                    f"direction(s), {row['seconds']:.0f}s ({row['signature']})"
                )
            if not follow or (run_finished(save_dir) and not unscored_tags(save_dir)):
                return scored
            time.sleep(poll_s)
    finally:
        out.close()
