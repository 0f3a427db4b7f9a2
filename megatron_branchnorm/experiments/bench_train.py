"""The ``trainstep``, ``pipeline`` and ``deep`` sections of tools/benchmark.py: train.py runs on
synthetic data, their ranks started as srun would (runner/ranks.py), the tokens/s of each
update read from the run's metrics.jsonl (formats/records.py)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

from megatron_branchnorm.experiments.bench_log import log
from megatron_branchnorm.formats.records import metrics_path, read_metrics
from megatron_branchnorm.resources import DS_CONFIG_DIR
from megatron_branchnorm.runner.launch import CHECKOUT
from megatron_branchnorm.runner.ranks import start_ranks


def train_run(
    overrides: list[str],
    ranks: int,
    threads_per_rank: int,
    save_dir: Path,
    timeout: float,
    root: Path = CHECKOUT,
) -> dict:
    """Run train.py of the tree ``root`` (ranks started directly, as under srun, in ``root``;
    each told it shares the cores with ``cores // threads_per_rank`` ranks, so it takes
    ``threads_per_rank`` threads); returns the metrics records of the updates, wall time to the
    first record, total wall time and the peak RSS of each rank (MiB, ``ru_maxrss``)."""
    args = [
        "--config", "tiny_cpu", f"train.save_dir={save_dir}", "train.save_interval=0",
        "train.eval_interval=100000", "train.log_interval=1", *overrides,
    ]  # fmt: skip
    env = {
        "LOCAL_SIZE": str(max(1, (os.cpu_count() or 2) // threads_per_rank)),
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    metrics = metrics_path(save_dir)
    t0 = time.time()
    # leaving the block kills the ranks still running (a timeout) and removes the shared-memory
    # all-reduce buffers DeepSpeed's CPU backend leaves in /dev/shm (~66 MB per rank)
    with start_ranks(ranks, args, save_dir, env=env, cwd=root) as group:
        first = None
        while True:
            if first is None and metrics.exists() and metrics.stat().st_size:
                first = time.time() - t0
            if None not in group.poll():
                break
            if time.time() - t0 > timeout:
                raise RuntimeError(f"train.py timed out after {timeout:.0f}s: {overrides}")
            time.sleep(0.05)
        wall = time.time() - t0
    if any(group.codes):
        tail = (save_dir / "rank0.log").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"train.py failed ({group.codes}): {tail}")
    records = [r for r in read_metrics(save_dir) if "tokens_per_sec" in r]
    return {
        "records": records,
        "first_step_s": first,
        "wall_s": wall,
        "peak_rss_mb": group.maxrss_mb,
    }


def _model_overrides(a: argparse.Namespace, layers: int | None = None) -> list[str]:
    n = layers or a.layers
    return [
        f"model.encoder_layers={n}", f"model.decoder_layers={n}", f"model.hidden_size={a.dim}",
        f"model.ffn_hidden_size={a.ffn}", f"model.num_attention_heads={a.heads}",
        f"model.vocab_size={a.vocab}", f"model.dropout={a.dropout}", "model.max_positions=128",
        "train.warmup_steps=100", "train.lr=5e-4", "train.clip_grad=0.0",
    ]  # fmt: skip


def bench_trainstep(a: argparse.Namespace, work: Path) -> dict:
    """Our whole training step through train.py (1 process, all cores), fp32 and bf16.

    Synthetic copy/reverse data, max_length = src so a micro-batch holds ~max_tokens
    tokens per side (source + target tokens are counted, pads not)."""
    out: dict = {}
    steps = a.warmup + a.steps * (1 if a.quick else 2)
    trees = {"ours": CHECKOUT}
    if a.base:
        trees["base"] = Path(a.base)
    for rnd in range(1 if a.quick else 2):
        for dt in a.dtypes.split(","):
            ds = DS_CONFIG_DIR / ("cpu_fp32.json" if dt == "fp32" else "zero1_bf16.json")
            if dt == "bf16":  # ZeRO-1 refuses our AdamW subclass unless told (see performance.md)
                conf = json.loads(ds.read_text())
                conf["zero_allow_untested_optimizer"] = True
                ds = work / "zero1_bf16_allow.json"
                ds.write_text(json.dumps(conf))
            for name, root in trees.items():
                save = work / f"trainstep_{name}_{dt}_{rnd}"
                shutil.rmtree(save, ignore_errors=True)
                ov = _model_overrides(a) + [
                    f"data.max_tokens={a.batch * a.src}", f"data.max_length={a.src}",
                    "train.micro_batches=1", f"train.max_steps={steps}",
                    f"train.deepspeed_config={ds}",
                ]  # fmt: skip
                res = train_run(ov, 1, a.threads, save, a.timeout, root)
                tps = [r["tokens_per_sec"] for r in res["records"][a.warmup :]]
                out.setdefault(f"{name}/{dt}", []).extend(tps)
                log(f"trainstep {name} {dt}: {statistics.median(tps):.0f} tokens/s")
    summary = {k: {"tokens_per_s": statistics.median(v), "n": len(v)} for k, v in out.items()}
    for dt in a.dtypes.split(","):
        if f"base/{dt}" in summary:
            summary[f"ours/base {dt}"] = (
                summary[f"ours/{dt}"]["tokens_per_s"] / summary[f"base/{dt}"]["tokens_per_s"]
            )
    return summary


def bench_pipeline(a: argparse.Namespace, work: Path) -> dict:
    """1 stage (1 thread) vs 2 stages x 1 thread, against the bubble-limited ideal.

    Rounds interleave the 1-stage run and the 2-stage runs, so a drift of the machine's speed
    moves the reference and the pipeline alike; figures are medians over all rounds' updates
    (the first update of each run, which includes warm-up, is left out)."""
    base = [
        "model.encoder_layers=6", "model.decoder_layers=6", "model.hidden_size=128",
        "model.ffn_hidden_size=512", "model.num_attention_heads=4", "model.vocab_size=1000",
        "model.dropout=0.1", "data.max_tokens=256", "data.max_length=32",
    ]  # fmt: skip
    mbs = [8] if a.quick else [4, 8, 16]
    steps = 3 if a.quick else 10
    rounds = 1 if a.quick else 2
    t1s: list[float] = []
    t2s: dict[int, list[float]] = {m: [] for m in mbs}
    for rnd in range(rounds):
        save = work / f"pipe1_r{rnd}"
        shutil.rmtree(save, ignore_errors=True)
        r1 = train_run(
            base + ["train.micro_batches=8", f"train.max_steps={steps}"], 1, 1, save, a.timeout
        )
        t1s += [r["tokens_per_sec"] for r in r1["records"][1:]]  # one rank, one thread
        for m in mbs:
            save = work / f"pipe2_m{m}_r{rnd}"
            shutil.rmtree(save, ignore_errors=True)
            r2 = train_run(
                base + [f"train.micro_batches={m}", f"train.max_steps={steps}", "pipeline.stages=2"],
                2, 1, save, a.timeout,
            )  # fmt: skip
            t2s[m] += [r["tokens_per_sec"] for r in r2["records"][1:]]
        log(f"pipeline round {rnd + 1}/{rounds} done")
    t1 = statistics.median(t1s)
    out: dict = {"1stage_tokens_per_s": t1, "rounds": rounds, "updates_per_run": steps - 1}
    for m in mbs:
        t2 = statistics.median(t2s[m])
        ideal = t1 * 2 * m / (m + 1)  # p=2: t1 * p * m / (m + p - 1)
        out[f"2stage_m{m}"] = {"tokens_per_s": t2, "ideal": ideal, "frac_ideal": t2 / ideal}
        log(f"pipeline m={m}: {t2:.0f} tokens/s = {t2 / ideal:.0%} of ideal {ideal:.0f}")
    return out


def bench_deep(a: argparse.Namespace, work: Path) -> dict:
    """A 500L-500L model at tiny width on 2 ranks: first step, peak RSS per rank."""
    n = 500
    save = work / "deep"
    shutil.rmtree(save, ignore_errors=True)
    ov = [
        f"model.encoder_layers={n}", f"model.decoder_layers={n}", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "model.num_attention_heads=2", "model.vocab_size=64",
        "data.max_tokens=128", "train.micro_batches=2", "train.max_steps=1", "pipeline.stages=2",
    ]  # fmt: skip
    res = train_run(ov, 2, 1, save, a.timeout)
    out = {
        "first_step_s": res["first_step_s"],
        "wall_s": res["wall_s"],
        "peak_rss_mb_per_rank": res["peak_rss_mb"],
    }
    log(f"500L-500L: first step at {res['first_step_s']:.1f}s, peak RSS {res['peak_rss_mb']}")
    return out
