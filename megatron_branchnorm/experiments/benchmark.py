"""Side-by-side performance benchmark against fairseq, torchscale and torch.nn.Transformer.

    python tools/benchmark.py --quick                       # ~ a few minutes on 2 cores
    python tools/benchmark.py --sections model,trainstep --rounds 5 --json out.json

Sections (``--sections``, comma-separated; default all but ``data``, which takes 10-20 minutes):

- ``model``: the model step (forward, the same fp32 label-smoothed loss, backward, a plain
  torch.optim.Adam step; one loop shared by every implementation, bench_models.py) for
  ours and each anchor, fp32 and bf16 autocast. Each implementation is a persistent worker
  process; rounds interleave implementations and dtypes; figures are medians. Prints tokens/s
  (source + target), achieved GFLOP/s (matmul FLOPs of the configuration), the fraction of
  the matmul peak measured in the same run, and our ratio to each anchor. fairseq and
  torchscale run in the throwaway environment of bench_anchors.py.
- ``trainstep``: our whole training step through megatron_branchnorm/train.py (fused loss,
  optimizer, loop overheads) on synthetic data of the same shape, fp32 and bf16.
- ``pipeline``: train.py on 1 stage (1 thread) and on 2 stages (2 ranks, 1 thread each) with
  4/8/16 micro-batches; the bubble-limited ideal is t1 * (m + p - 1) / (m * p).
- ``deep``: a 500L-500L model at tiny width on 2 ranks: time to the first step, peak RSS per
  rank, parameters per rank.
- ``beam``: beam search (beam 4) sentences/s, ours (and ours at ``--baseline``, in the same
  process) vs transformers generate on our HF export; ``--beam-reps``, ``--beam-sentences``.
  Random weights by default (every sentence runs to its length limit); ``--beam-export E
  --beam-data D`` times a trained export on the first test sentences of each direction of D.
- ``preprocess``: tools/preprocess_data.py sentence pairs/s on a locale corpus.
- ``launches``: kernel-launching aten ops per encoder and decoder layer per micro-batch inside
  DeepSpeed's ``train_batch``, host syncs per micro-batch and the last stage's peak memory,
  for the shipped configs in ``--launch-configs`` (launches.py). Counts, not
  timings: the load does not move them.
- ``data``: the data path at real size (bench_data.py): for each N of
  ``--data-pairs`` a synthetic OPUS-100-shaped corpus of N pairs (cached in ``--workdir``),
  tools/preprocess_data.py's wall time and peak memory (per phase with its ``--stats``; the
  process tree's sampled RSS always), then for ``--data-train-pairs`` the training start-up
  (first update, peak RSS per rank) at 2 data-parallel ranks and at 4 stages, and a linear
  projection to 55M pairs. ``--checkout DIR`` measures another tree's tools (the "before"):

      python tools/benchmark.py --sections data --workdir /tmp/mbn_bench_data --json data.json

Always record the machine load: timings on a shared machine are noisy; ratios within one run
are what the script reports.

This module is the command line and the report; each section lives in its own module:
``model`` in bench_step.py, ``trainstep``/``pipeline``/``deep`` in bench_train.py, ``beam`` in
bench_beam.py, ``preprocess`` in bench_preprocess.py, ``launches`` in launches.py and ``data``
in bench_data.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.experiments import bench_models
from megatron_branchnorm.experiments.bench_beam import bench_beam
from megatron_branchnorm.experiments.bench_log import load, log
from megatron_branchnorm.experiments.bench_preprocess import bench_preprocess
from megatron_branchnorm.experiments.bench_step import bench_model, matmul_peak
from megatron_branchnorm.experiments.bench_train import bench_deep, bench_pipeline, bench_trainstep
from megatron_branchnorm.formats.outputs import (
    check_output_file,
    check_scratch_dir,
    read_report,
    write_text_output,
)
from megatron_branchnorm.runner.hardware import cpu_info, default_dtypes
from megatron_branchnorm.runner.launch import CHECKOUT

__all__ = ["SECTIONS", "bench_beam", "load", "log", "main", "matmul_peak"]

SECTIONS = ("model", "trainstep", "pipeline", "deep", "beam", "preprocess", "launches", "data")


# ---------------------------------------------------------------------------------------------
# Sections measured by modules of their own (launches.py, bench_data.py): their arguments
# ---------------------------------------------------------------------------------------------


def bench_launches(a: argparse.Namespace, work: Path) -> dict:
    """Kernel-launching ops per layer per micro-batch, host syncs (syncing ops, device-to-host
    copies, synchronize calls) and the last stage's peak memory of each config in
    ``--launch-configs`` (launches.measure)."""
    from megatron_branchnorm.experiments import launches  # torch: only when this section runs

    configs = [c for c in (a.launch_configs or ",".join(launches.DEFAULT_CONFIGS)).split(",") if c]
    res = launches.measure(configs, timeout=a.timeout)
    for name, r in res["configs"].items():
        log(
            f"launches {name}: enc {r['enc_ops_per_layer_mb']:.1f}, dec "
            f"{r['dec_ops_per_layer_mb']:.1f} ops/layer/micro-batch, "
            f"{r['host_syncs_per_mb']:.2f} host syncs, {r['d2h_copies_per_mb']:.2f} "
            f"device-to-host copies, {r['sync_calls_per_mb']:.2f} synchronize calls/micro-batch"
        )
    return res


def _pair_list(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def bench_data(a: argparse.Namespace, work: Path) -> dict:
    """Preprocessing and training start-up on synthetic OPUS-100-shaped corpora
    (bench_data.measure)."""
    from megatron_branchnorm.experiments import bench_data as bd

    quick = a.quick and a.data_pairs is None
    pairs = (
        _pair_list(a.data_pairs)
        if a.data_pairs
        else list(bd.QUICK_PAIRS if quick else bd.DEFAULT_PAIRS)
    )
    if a.data_train_pairs is not None:
        train = _pair_list(a.data_train_pairs)
    else:
        train = [min(pairs)] if quick else list(bd.DEFAULT_TRAIN_PAIRS)
    checkout = Path(a.checkout) if a.checkout else CHECKOUT
    vocab = a.data_vocab_size or (16000 if quick else 64000)
    return bd.measure(work, checkout, pairs, train, vocab, a.data_workers, a.timeout, log=log)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def print_report(res: dict) -> None:
    print(f"# benchmark {res['date']}  ({res['machine']})")
    print(f"command: {res['command']}")
    print(f"load at start/end: {res['load_start']} / {res['load_end']}")
    if "cpu" in res:
        print(f"{res['cpu']}; precisions run: {res['dtypes']}")
    if "peak" in res:
        peaks = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in res["peak"].items())
        print(f"matmul peak: {peaks}")
    if "model" in res:
        m = res["model"]
        print(f"\n## model step: {m['config']} ({m['gflop_per_step']:.0f} GFLOP/step)")
        print(f"{'impl/dtype':<18}{'s/step':>8}{'tokens/s':>10}{'GFLOP/s':>9}{'of peak':>9}  n")
        for k, r in m["rows"].items():
            print(
                f"{k:<18}{r['s_per_step']:>8.3f}{r['tokens_per_s']:>10.0f}{r['gflops']:>9.0f}"
                f"{r['frac_peak']:>9.1%}  {r['n']}"
            )
        for k, v in m["ratios"].items():
            print(f"ratio {k}: {v:.2f}x")
        for k, v in m["skipped"].items():
            print(f"skipped {k}: {v}")
    for key in ("trainstep", "pipeline", "deep", "beam", "preprocess"):
        if key in res:
            print(f"\n## {key}\n{json.dumps(res[key], indent=1)}")
    if "launches" in res:
        from megatron_branchnorm.experiments.launches import format_table

        r = res["launches"]
        text = json.dumps(r) if "error" in r else format_table(r)
        print(f"\n## launches (kernel-launching ops per layer per micro-batch)\n{text}")
    if "data" in res:
        from megatron_branchnorm.experiments.bench_data import format_table

        r = res["data"]
        text = json.dumps(r) if "error" in r else format_table(r)
        print(f"\n## data (synthetic OPUS-100-shaped corpora)\n{text}")


WORK_ENTRIES = (
    "base", "hf", "corpus", "data", "deep", "zero1_bf16_allow.json", "trainstep_*", "pipe1_*",
    "pipe2_*", "opus_like_*", "data_*", "preprocess_*.log", "train_*",
)  # fmt: skip
"""What the sections write in --workdir (bench_train.py, bench_beam.py, bench_preprocess.py,
bench_data.py): a directory holding only these is an earlier --workdir of ours, reused (the
data section's corpora are cached there)."""


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of ours: an object whose ``command`` is this
    tool's."""
    data = read_report(path)
    return isinstance(data, dict) and str(data.get("command", "")).startswith(
        "python tools/benchmark.py"
    )


def check_outputs(workdir: str | None, json_path: str | None) -> None:
    """Before anything runs: --workdir new, empty or an earlier one of ours
    (:data:`WORK_ENTRIES`), never inside a directory of a known kind; --json not inside one
    either, and an existing file replaced only when it is a report of ours."""
    if workdir is not None:
        check_scratch_dir(workdir, "--workdir", "benchmark", WORK_ENTRIES)
    if json_path is not None:
        inputs = [("--workdir", workdir)]
        check_output_file(
            json_path, "--json", inputs, is_our_report, "a report of benchmark --json"
        )


def main(argv: list[str] | None = None) -> int:
    """Parse, run the sections, print the report. A refused output or another bad input is
    one line ``error: ...`` and exit 2."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_models.add_model_args(p)
    p.add_argument("--quick", action="store_true", help="short version (1 round, fewer runs)")
    p.add_argument(
        "--sections",
        default=",".join(s for s in SECTIONS if s != "data"),
        help=f"of {','.join(SECTIONS)} (default all but data)",
    )
    p.add_argument("--impls", default="ours,torch,fairseq,torchscale")
    p.add_argument(
        "--dtypes",
        default=None,
        help="fp32,bf16 (default on a CPU: bf16 only where the CPU has AVX-512-BF16 or AMX)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (model step)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per worker and dtype")
    p.add_argument("--timeout", type=float, default=900.0, help="per train.py run (s)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--beam-sentences",
        type=int,
        default=0,
        help="beam: sentences (per direction with --beam-export; 0: 32)",
    )
    p.add_argument("--beam-reps", type=int, default=0, help="beam: timed repetitions (0: 3)")
    p.add_argument(
        "--beam-export",
        default=None,
        help="beam: a trained export (tools/convert_checkpoint.py) instead of random weights",
    )
    p.add_argument(
        "--beam-data", default=None, help="beam: with --beam-export, its DATA_DIR (test split)"
    )
    p.add_argument(
        "--beam-engines",
        action="store_true",
        help="beam: with --beam-export, also ours vs generate vs CTranslate2 float32/int8 "
        "(bench_beam.bench_engines)",
    )
    p.add_argument(
        "--launch-configs",
        default=None,
        help="launches: the shipped configs whose ops per layer are counted "
        "(default: opus100_12L,opus100_200L,opus100_1000L)",
    )
    p.add_argument(
        "--data-pairs",
        default=None,
        help="data: corpus sizes to preprocess (default 250000,1000000,4000000; --quick "
        "20000,60000)",
    )
    p.add_argument(
        "--data-train-pairs",
        default=None,
        help="data: sizes whose DATA_DIR is also trained on at 2 ranks and 4 stages (default "
        "1000000; --quick the smallest; '' none)",
    )
    p.add_argument(
        "--data-vocab-size",
        type=int,
        default=None,
        help="data: --vocab-size (default 64000; --quick 16000: a small corpus has too few pieces)",
    )
    p.add_argument("--data-workers", type=int, default=2, help="data: --workers")
    p.add_argument(
        "--checkout",
        default=None,
        help="data: run this tree's tools/preprocess_data.py and train (PYTHONPATH=DIR)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="a git revision of this repo: also time our code at that revision ('base')",
    )
    a = p.parse_args(argv)
    check_outputs(a.workdir, a.json)
    cpu = cpu_info()
    log(cpu.describe())
    if a.dtypes is None:
        a.dtypes = ",".join(default_dtypes(cpu) if a.device == "cpu" else ("fp32", "bf16"))
        if a.device == "cpu" and not cpu.native_bf16:
            log("bf16 sections skipped: no native bf16 on this CPU (--dtypes fp32,bf16 forces)")
    if a.quick:
        a.rounds, a.steps = 1, 2
    sections = [s for s in a.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)} (of {', '.join(SECTIONS)})")
    if bool(a.beam_export) != bool(a.beam_data):
        p.error("--beam-export and --beam-data go together")
    if a.beam_engines and not a.beam_export:
        p.error("--beam-engines needs --beam-export and --beam-data (a trained export)")
    # absolute: train.py runs in the tree it times (--baseline: another one)
    work = Path(a.workdir).resolve() if a.workdir else Path(tempfile.mkdtemp(prefix="mbn_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    a.base = None
    if a.baseline:
        a.base = str(work / "base")
        shutil.rmtree(a.base, ignore_errors=True)
        os.makedirs(a.base)
        tar = subprocess.run(
            ["git", "-C", str(CHECKOUT), "archive", a.baseline, "megatron_branchnorm"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", a.base], input=tar, check=True)
        if "base" not in a.impls.split(","):
            a.impls = f"{a.impls},base"
    res: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(
            ["python", "tools/benchmark.py", *(sys.argv[1:] if argv is None else argv)]
        ),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_start": load(),
        "cpu": cpu.describe(),
        "dtypes": a.dtypes,
    }
    if a.device != "cpu":
        import torch

        res["machine"] += f", {torch.cuda.get_device_name()}"
    if "model" in sections:
        res["peak"] = matmul_peak(a.threads, device=a.device, dtypes=tuple(a.dtypes.split(",")))
        log(f"matmul peak {res['peak']}")
        res["model"] = bench_model(a, res["peak"])
    runners = {
        "trainstep": bench_trainstep,
        "pipeline": bench_pipeline,
        "deep": bench_deep,
        "beam": bench_beam,
        "preprocess": bench_preprocess,
        "launches": bench_launches,
        "data": bench_data,
    }
    for name, fn in runners.items():
        if name in sections:
            try:
                res[name] = fn(a, work)
            except Exception as e:  # noqa: BLE001 - one failed section does not lose the rest
                res[name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"{name} failed: {e}")
    res["load_end"] = load()
    if a.json:  # before the report: a report bug must not lose the figures
        write_text_output(a.json, json.dumps(res, indent=1))
    print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
