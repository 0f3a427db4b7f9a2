"""Validation BLEU of a training run's checkpoints, from a companion process beside training:
each complete checkpoint is scored once on the dev split and written to
SAVE_DIR/valid_bleu.jsonl and TensorBoard (megatron_branchnorm/inference/valid_bleu.py).

    python tools/watch_bleu.py --checkpoint runs/opus100_12L --follow    # until training ends
    python tools/watch_bleu.py --checkpoint runs/x --max-sentences 100 --directions de-en,en-de
    python tools/watch_bleu.py --checkpoint runs/wmt17 --bleu tokenized --compound-split

With train.best_metric=valid_bleu and train.keep_best=N, checkpoint retention keeps the N
checkpoints with the highest valid_bleu, and every checkpoint this process has yet to score.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from megatron_branchnorm.cli import ArgumentParser, UsageError, float_flag, int_flag, run_main

PROG = "watch_bleu.py"
LOCK = ".valid_bleu.lock"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from megatron_branchnorm.inference.evaluate import add_scoring_args

    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", required=True, help="the run's save_dir")
    p.add_argument("--data", default=None, help="DATA_DIR (default: the checkpoint's data.dataset)")
    p.add_argument("--split", default="dev", choices=("dev", "test"), help="default dev")
    p.add_argument(
        "--max-sentences", type=int_flag(1), default=200, help="first N per direction (200)"
    )
    p.add_argument("--directions", default=None, help="comma-separated subset, e.g. de-en,en-de")
    p.add_argument("--beam", type=int_flag(1, 64), default=4, help="beam size (4)")
    add_scoring_args(p)
    p.add_argument("--follow", action="store_true", help="keep scoring until training ends")
    p.add_argument(
        "--poll-s", type=float_flag(0.1), default=60.0, help="--follow: seconds between looks"
    )
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    p.add_argument("--threads", type=int_flag(0), default=0, help="torch threads (0: default)")
    return p.parse_args(argv)


def check_device(device: str) -> None:
    """A UsageError for a --device that is not cpu or a CUDA device this machine has."""
    import torch

    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device!r}: expected cpu, cuda or cuda:N")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device on this machine; use --device cpu")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise UsageError(
                f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )


def _watch(argv: list[str] | None) -> int:
    import fcntl

    import torch

    from megatron_branchnorm.formats.records import BLEU_FILE
    from megatron_branchnorm.inference.evaluate import Scoring
    from megatron_branchnorm.inference.valid_bleu import WatchOptions, watch

    args = parse_args(argv)
    save_dir = Path(args.checkpoint)
    if not save_dir.is_dir():
        raise UsageError(f"--checkpoint {save_dir}: no such directory")
    check_device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    scoring = Scoring.from_args(args)
    scoring.check()
    wanted = None
    if args.directions:
        wanted = [x.strip() for x in args.directions.split(",") if x.strip()]
    opts = WatchOptions(
        args.data, args.split, args.max_sentences, wanted, args.beam, scoring, args.device
    )
    with open(save_dir / LOCK, "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            raise UsageError(
                f"--checkpoint {save_dir}: another watch_bleu.py is scoring this run "
                f"({save_dir / LOCK} is locked)"
            ) from None
        n = watch(save_dir, opts, args.follow, args.poll_s, lambda m: print(m, flush=True))
    print(f"{n} checkpoint(s) scored; rows in {save_dir / BLEU_FILE}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Bad input is one line ``error: ...`` and exit 2; Ctrl-C exits 130."""
    return run_main(_watch, argv)


if __name__ == "__main__":
    sys.exit(main())
