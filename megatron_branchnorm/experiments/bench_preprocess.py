"""The ``preprocess`` section of tools/benchmark.py: tools/preprocess_data.py's sentence pairs/s
on a locale corpus built here."""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from megatron_branchnorm.experiments.bench_log import log
from megatron_branchnorm.runner.launch import CHECKOUT, tool_command


def bench_preprocess(a: argparse.Namespace, work: Path) -> dict:
    """Sentence pairs/s of tools/preprocess_data.py on a locale corpus (built here)."""
    corpus = work / "corpus"
    if not corpus.exists():
        subprocess.run(
            [*tool_command("corpus"), "--output", str(corpus), "--langs", "de,fr"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=CHECKOUT,
        )  # fmt: skip
    out_dir = work / "data"
    shutil.rmtree(out_dir, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(
        [*tool_command("preprocess"), "--format", "opus100",
         "--input", str(corpus), "--langs", "de,fr", "--output", str(out_dir),
         "--vocab-size", "2000"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=CHECKOUT,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    manifest = json.loads((out_dir / "manifest.json").read_text())
    pairs = _count_pairs(manifest)
    res = {"pairs": pairs, "wall_s": wall, "pairs_per_s": pairs / wall if pairs else None}
    log(f"preprocess: {pairs} pairs in {wall:.1f}s")
    return res


def _count_pairs(manifest: dict) -> int:
    """Raw sentence pairs read, over every split and language pair of a data manifest."""
    return sum(
        int(pair.get("raw_sentences", pair.get("sentences", 0)))
        for split in manifest.get("splits", {}).values()
        for pair in split.get("pairs", {}).values()
    )
