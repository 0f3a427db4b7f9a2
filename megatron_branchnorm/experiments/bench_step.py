"""The ``model`` section of tools/benchmark.py: the matmul peak of this machine, and the model
step (forward, loss, backward, Adam) of ours and of each anchor, each implementation served by
a persistent bench_models.py worker process, rounds interleaving implementations and dtypes.
The figures are medians; ratios within one run are what it reports."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from megatron_branchnorm.experiments import bench_anchors, bench_models
from megatron_branchnorm.experiments.bench_log import log
from megatron_branchnorm.runner.launch import CHECKOUT


def matmul_peak(
    threads: int,
    n: int = 2048,
    reps: int = 5,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
) -> dict[str, float]:
    """Best-of GFLOP/s of an n x n x n matmul per dtype (n = 8192 on a GPU). Only the dtypes
    asked for: without AVX-512-bf16/AMX one bf16 2048^3 matmul takes minutes on a CPU."""
    import torch

    torch.set_num_threads(threads)
    n = 8192 if device != "cpu" else n
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in dtypes:
            continue
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        a @ b
        sync()

        def mm(a=a, b=b) -> None:
            a @ b
            sync()

        best = min(_timed(mm) for _ in range(reps))
        out[name] = 2 * n**3 / best / 1e9
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Model step
# ---------------------------------------------------------------------------------------------


class Worker:
    """A bench_models.py process serving one implementation."""

    def __init__(self, impl: str, python: str, args: list[str], env: dict) -> None:
        self.impl = impl
        self.proc = subprocess.Popen(
            [python, "-m", "megatron_branchnorm.experiments.bench_models", "--impl", impl, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{impl}: the worker exited before it was ready")
        self.info = json.loads(line)

    def run(self, dtype: str, steps: int) -> list[float]:
        self.proc.stdin.write(json.dumps({"dtype": dtype, "steps": steps}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["times"]

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"quit": true}\n')
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=60)


def bench_model(a: argparse.Namespace, peak: dict[str, float]) -> dict:
    """Interleaved model-step timings of every available implementation."""
    margs = [
        f"--layers={a.layers}", f"--dim={a.dim}", f"--ffn={a.ffn}", f"--heads={a.heads}",
        f"--vocab={a.vocab}", f"--batch={a.batch}", f"--src={a.src}", f"--tgt={a.tgt}",
        f"--dropout={a.dropout}", f"--threads={a.threads}", f"--device={a.device}",
    ]  # fmt: skip
    impls = [i for i in a.impls.split(",") if i]
    anchor_py, status = None, {}
    if {"fairseq", "torchscale"} & set(impls):
        log("preparing the anchors' environment (first time: minutes)")
        anchor_py = str(bench_anchors.prepare_anchor_env())
        status = bench_anchors.anchor_status()
    skipped: dict[str, str] = {}
    env = dict(os.environ, **bench_anchors.ANCHOR_ENV)
    # the workers import bench_models from this checkout (the anchors' python has no install)
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")])
    specs = {}  # impl -> (worker impl, python, extra args)
    for impl in impls:
        if impl in ("fairseq", "torchscale") and status.get(impl) != "ok":
            skipped[impl] = status.get(impl, "not prepared")
        elif impl in ("fairseq", "torchscale"):
            specs[impl] = (impl, anchor_py, [])
        elif impl == "base":
            specs[impl] = ("ours", sys.executable, [f"--root={a.base}"])
        else:
            specs[impl] = (impl, sys.executable, [])
    dtypes = a.dtypes.split(",")
    # One worker alive at a time (memory on a shared machine); every round starts each
    # implementation afresh, warms it up and times it, in alternating order.
    times: dict[str, dict[str, list[float]]] = {i: {d: [] for d in dtypes} for i in specs}
    params = {}
    for r in range(a.rounds):
        order = list(specs) if r % 2 == 0 else list(reversed(specs))
        for impl in order:
            if impl in skipped:
                continue
            wimpl, py, extra = specs[impl]
            try:
                w = Worker(wimpl, py, [*margs, *extra], env)
            except Exception as e:  # noqa: BLE001 - reported as skipped
                skipped[impl] = str(e)
                continue
            params[impl] = w.info["params"]
            for dt in dtypes:
                w.run(dt, a.warmup)  # allocator, autocast caches, Adam state
                times[impl][dt] += w.run(dt, a.steps)
                log(f"model step {impl}/{dt}: {[round(t, 3) for t in times[impl][dt]]} s")
            w.close()
        log(f"round {r + 1}/{a.rounds} done")
    workers = [i for i in specs if i not in skipped]
    times = {i: times[i] for i in workers}
    tokens = a.batch * (a.src + a.tgt)
    flops = bench_models.model_flops(a.layers, a.dim, a.ffn, a.vocab, a.batch, a.src, a.tgt)
    rows = {}
    for impl, per_dtype in times.items():
        for dt, ts in per_dtype.items():
            med = statistics.median(ts)
            rows[f"{impl}/{dt}"] = {
                "s_per_step": med,
                "tokens_per_s": tokens / med,
                "gflops": flops / med / 1e9,
                "frac_peak": flops / med / 1e9 / peak[dt],
                "n": len(ts),
                "spread": (min(ts), max(ts)),
            }
    ratios = {}
    for dt in dtypes:
        ours = rows.get(f"ours/{dt}")
        for impl in workers:
            if impl != "ours" and ours and f"{impl}/{dt}" in rows:
                ratios[f"ours/{impl} {dt}"] = (
                    ours["tokens_per_s"] / rows[f"{impl}/{dt}"]["tokens_per_s"]
                )
    if "ours/fp32" in rows and "ours/bf16" in rows:
        ratios["ours bf16/fp32"] = (
            rows["ours/bf16"]["tokens_per_s"] / rows["ours/fp32"]["tokens_per_s"]
        )
    return {
        "config": f"{a.layers}L-{a.layers}L d={a.dim} ffn={a.ffn} heads={a.heads} "
        f"vocab={a.vocab} batch={a.batch}x({a.src}+{a.tgt}) dropout={a.dropout}",
        "gflop_per_step": flops / 1e9,
        "rows": rows,
        "ratios": ratios,
        "skipped": skipped,
        "params": params,
    }
