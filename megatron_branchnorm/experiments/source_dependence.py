"""How much an exported model reads its source: teacher-forced NLL per target token on held-out
sentences with the true source, with the sources shuffled across the batch, and with only the
language tag (an empty source). A model that has only learnt a target-side language model scores
the three alike (docs/demo.md).

    python tools/source_dependence.py runs/demo/export/final --data runs/demo/data
"""

from __future__ import annotations

import argparse
import sys

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.data import BatchSampler, TranslationData
from megatron_branchnorm.experiments.analysis import source_dependence
from megatron_branchnorm.inference.export import load_export


def _measure(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("export", help="export directory (tools/convert_checkpoint.py)")
    parser.add_argument("--data", required=True, help="preprocessed data directory")
    parser.add_argument("--split", default="dev", help="held-out split (default dev)")
    parser.add_argument("--batches", type=int, default=15, help="batches of 2048 tokens")
    args = parser.parse_args(argv)
    model, _, _ = load_export(args.export)
    data = TranslationData(args.data, args.split, max_length=None)
    batches = list(BatchSampler(data, 2048, 1.0, 1, shuffle=False))[: args.batches]
    res = source_dependence(model, batches)
    print(" | ".join(f"{k} source {v:.3f}" for k, v in res.items()), "(NLL per target token)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Bad input (the export, the data) is one line ``error: ...`` and exit 2."""
    return run_main(_measure, argv)


if __name__ == "__main__":
    sys.exit(main())
