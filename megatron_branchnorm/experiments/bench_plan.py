"""Training data at OPUS-100's size: what a data-reading rank holds and how long an
epoch's plan takes, for a DATA_DIR of N sentence pairs, today's code against another
checkout's.

    python -m megatron_branchnorm.experiments.bench_plan --pairs 5000000,55000000 \\
        --baseline-checkout /path/to/old/checkout

Building a real DATA_DIR of 55M pairs takes hours; the plans depend only on the sequence
lengths, so this writes a DATA_DIR whose ``.idx`` files hold OPUS-100-like lengths and whose
``.bin`` files are sparse (the right size, no blocks on disk; nothing here reads a token).
Pairs: ``--n-pairs`` (99, OPUS-100's), sizes falling geometrically 1M:15k and scaled to N; both
directions of each pair train, so an epoch holds 2N samples. Lengths: log-normal around 25
tokens, at most ``--max-len``, the two sides correlated.

Each measurement runs in a fresh process (peak RSS is the process's ``ru_maxrss``):

- ``load``: TranslationData and BatchSampler of the train split (what every data rank holds);
- ``whole``: and one whole epoch's plan, ``BatchSampler._plan`` (what every rank built before the
  stream was split by rank, on every stage);
- ``share``: and the plan of data-parallel rank 0 of ``--dp`` (``BatchSampler.epoch_plan``,
  what a first- or last-stage rank builds now); its build runs on a thread while the previous
  epoch trains, so the step waits only when an epoch trains faster than this.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.formats.outputs import (
    check_output_file,
    check_scratch_dir,
    read_report,
    write_text_output,
)
from megatron_branchnorm.runner.hardware import cpu_info

MODES = ("load", "whole", "share")


def pair_sizes(total: int, n_pairs: int) -> np.ndarray:
    """Training pairs per language pair: geometric, largest/smallest = 1M/15k, summing to
    ``total``."""
    ratio = (15_000 / 1_000_000) ** (1 / max(1, n_pairs - 1))
    w = ratio ** np.arange(n_pairs)
    sizes = np.floor(total * w / w.sum()).astype(np.int64)
    sizes[0] += total - int(sizes.sum())
    return sizes


def _write_index(prefix: Path, lengths: np.ndarray) -> None:
    """A valid ``.idx`` (indexed_dataset's layout, uint16 ids) and a sparse ``.bin``."""
    from megatron_branchnorm.data import indexed_dataset as ix

    lengths = lengths.astype("<i4")
    offsets = np.zeros(lengths.size, dtype="<i8")
    np.cumsum(lengths[:-1], out=offsets[1:])
    total = int(lengths.sum(dtype=np.int64))
    with open(ix.index_path(prefix), "wb") as f:
        f.write(struct.pack("<8sIB3xQQ", ix.MAGIC, ix.VERSION, 1, lengths.size, total))
        f.write(lengths.tobytes())
        f.write(offsets.tobytes())
    with open(ix.data_path(prefix), "wb") as f:
        f.truncate(total * 2)


def write_data_dir(out: Path, total: int, n_pairs: int, max_len: int, seed: int = 1) -> Path:
    """A train-only DATA_DIR of ``total`` pairs whose ``.bin`` files are sparse."""
    from megatron_branchnorm.data.preprocess import MANIFEST, MANIFEST_FORMAT, MANIFEST_VERSION

    if (out / MANIFEST).is_file():
        return out
    (out / "bin").mkdir(parents=True, exist_ok=True)
    (out / "spm.model").write_bytes(b"")
    rng = np.random.default_rng(seed)
    langs = [f"l{i:02d}" for i in range(n_pairs)]
    directions = {}
    for lang, n in zip(langs, pair_sizes(total, n_pairs).tolist(), strict=True):
        pair = f"en-{lang}"
        en = np.clip(rng.lognormal(np.log(22), 0.6, n), 1, max_len).astype(np.int32)
        other = np.clip(en * rng.lognormal(0.1, 0.2, n), 1, max_len).astype(np.int32)
        for code, lengths in (("en", en), (lang, other)):
            _write_index(out / "bin" / f"train.{pair}.{code}", lengths)
        for src, tgt in (("en", lang), (lang, "en")):
            directions[f"{src}-{tgt}"] = {
                "src": f"bin/train.{pair}.{src}",
                "tgt": f"bin/train.{pair}.{tgt}",
                "sentences": n,
            }
    all_langs = sorted(["en", *langs])
    manifest = {
        "format": MANIFEST_FORMAT,
        "version": MANIFEST_VERSION,
        "vocab_size": 64000,
        "languages": all_langs,
        "tag_ids": {lang: 4 + i for i, lang in enumerate(all_langs)},
        "spm_model": "spm.model",
        "directions": sorted(directions),
        "splits": {"train": {"directions": dict(sorted(directions.items()))}},
    }
    (out / MANIFEST).write_text(json.dumps(manifest))
    return out


def measure(data_dir: str, mode: str, max_tokens: int, max_len: int, dp: int) -> dict:
    """One measurement in this process (run it in a fresh one)."""
    from megatron_branchnorm.data.dataset import BatchSampler, TranslationData

    t0 = time.perf_counter()
    data = TranslationData(data_dir, "train", max_length=max_len)
    sampler = BatchSampler(data, max_tokens, 5.0, seed=1)
    out = {"mode": mode, "samples": int(sampler.counts.sum()), "load_s": time.perf_counter() - t0}
    out["load_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t1 = time.perf_counter()
    if mode == "whole":
        out["batches_held"] = len(sampler._plan(0))
    elif mode == "share":
        plan = sampler.epoch_plan(0, lambda pos: pos % dp == 0)
        out["batches_held"] = len(plan.mine)
        out["batches"] = len(plan)
    out["plan_s"] = time.perf_counter() - t1
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["anon_rss_mb"] = _anon_rss_mb()
    return out


def _anon_rss_mb() -> float:
    """Resident anonymous memory now (the page cache of the memory-mapped indexes, which
    ru_maxrss also counts, excluded)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def run_one(checkout: Path, data_dir: Path, mode: str, args) -> dict:
    code = (
        "import json,sys; from megatron_branchnorm.experiments.bench_plan import measure; "
        "print(json.dumps(measure(*sys.argv[1:3], *map(int, sys.argv[3:]))))"
    )
    if mode != "share" and checkout != Path(__file__).resolve().parents[2]:
        # another checkout predates this file: run this file's measure() with its package
        code = code.replace(
            "from megatron_branchnorm.experiments.bench_plan import measure",
            f"sys.path.insert(0, {str(Path(__file__).parent)!r}); from bench_plan import measure",
        )
    env = {**os.environ, "PYTHONPATH": str(checkout), "OMP_NUM_THREADS": "1"}
    argv = [str(data_dir), mode, str(args.max_tokens), str(args.max_len), str(args.dp)]
    proc = subprocess.run(
        [sys.executable, "-c", code, *argv],
        env=env,
        cwd=checkout,  # python -c puts the working directory first on sys.path
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise SystemExit(f"{mode} at {checkout} failed: {proc.stderr[-1500:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


REPORT_KEYS = frozenset({"cpu", "rows"})
"""The keys of a --json report: how one of ours is recognised."""


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours (exactly :data:`REPORT_KEYS`)."""
    data = read_report(path)
    return isinstance(data, dict) and set(data) == REPORT_KEYS


def check_outputs(args: argparse.Namespace) -> None:
    """Before any DATA_DIR is written: --work new, empty or an earlier cache of ours (only
    ``pairs_N`` DATA_DIRs), never inside a directory of a known kind; --json not inside one
    either, not in --work, and an existing file replaced only when it is a report of ours."""
    inputs = [("--baseline-checkout", args.baseline_checkout)]
    check_scratch_dir(args.work, "--work", "bench_plan", ("pairs_*",), inputs)
    if args.json is not None:
        inputs.append(("--work", args.work))
        check_output_file(
            args.json, "--json", inputs, is_our_report, "a report of bench_plan --json"
        )


def main(argv: list[str] | None = None) -> int:
    """Build or reuse the DATA_DIRs, time each mode, print a row each. A refused output is
    one line ``error: ...`` and exit 2."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pairs", default="1000000,5000000", help="comma-separated pair counts")
    ap.add_argument("--n-pairs", type=int, default=99)
    ap.add_argument("--max-tokens", type=int, default=4096)
    ap.add_argument("--max-len", type=int, default=256)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--work", default="runs/bench_plan", help="where the DATA_DIRs are cached")
    ap.add_argument("--baseline-checkout", default=None, help="a checkout of the code before")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    check_outputs(args)
    here = Path(__file__).resolve().parents[2]
    info = cpu_info()
    print(f"# {info.model}; flags: {' '.join(info.flags)}")
    print(f"# load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    rows = []
    for n in [int(x) for x in args.pairs.split(",")]:
        data_dir = write_data_dir(
            Path(args.work) / f"pairs_{n}", n, args.n_pairs, args.max_len, seed=1
        )
        runs = []
        if args.baseline_checkout:
            runs += [("before", Path(args.baseline_checkout), m) for m in ("load", "whole")]
        runs += [("after", here, m) for m in ("load", "share")]
        for label, checkout, mode in runs:
            r = run_one(checkout, data_dir, mode, args)
            r.update(pairs=n, code=label)
            rows.append(r)
            print(
                f"{n:>11,} pairs {label:>6} {mode:>5}: {r['samples']:>11,} samples, load "
                f"{r['load_s']:6.1f} s {r['load_rss_mb']:8.0f} MB; plan {r['plan_s']:6.1f} s, "
                f"peak {r['peak_rss_mb']:6.0f} MB, anon after {r['anon_rss_mb']:6.0f} MB, held {r.get('batches_held', 0):,}"
                + (f" of {r['batches']:,}" if "batches" in r else ""),
                flush=True,
            )
    if args.json:
        write_text_output(
            args.json, json.dumps({"cpu": [info.model, *info.flags], "rows": rows}, indent=1)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
