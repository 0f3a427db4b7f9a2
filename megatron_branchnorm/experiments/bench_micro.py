"""Micro-benchmarks and a profile behind docs/performance.md (one change at a time).

    python tools/_bench_micro.py                 # loss and Adam variants, interleaved, medians
    python tools/_bench_micro.py --profile ours  # op profile of one model step (12L-12L)
    python tools/_bench_micro.py --profile ours --bf16
    python tools/_bench_micro.py --dropout-ab    # our CPU dropout vs F.dropout, alone and in a step
    python tools/_bench_micro.py --compile-ab    # the residual tail LN(x + a*drop(y)), eager vs compiled
    python tools/_bench_micro.py --split-ab      # attention heads: unbind (the model's) vs slicing
    python tools/_bench_micro.py --recompute-ab  # a layer's host time, recomputed or not

Variants timed in one run: the label-smoothed loss (reference log_softmax form vs the fused
autograd function, forward + backward on (2048, 8000) logits) and Adam over our 12L-12L
model's parameters (for-loop, foreach, fused).
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time

import torch

from megatron_branchnorm.experiments import bench_models as bm
from megatron_branchnorm.model.loss import (
    label_smoothed_nll_loss,
    reference_label_smoothed_nll_loss,
)


def micro(a: argparse.Namespace) -> None:
    z = torch.randn(a.batch, a.tgt, a.vocab, requires_grad=True)
    t = torch.randint(4, a.vocab, (a.batch, a.tgt))

    def loss(fn) -> None:
        fn(z, t, 0.1)[0].backward()
        z.grad = None

    params = list(bm.build_ours(a).parameters())
    for p in params:
        p.grad = torch.randn_like(p)
    opts = {
        "adam_forloop": torch.optim.Adam(params, lr=1e-9, foreach=False),
        "adam_foreach": torch.optim.Adam(params, lr=1e-9, foreach=True),
        "adam_fused": torch.optim.Adam(params, lr=1e-9, fused=True),
    }
    cases = [
        ("loss_reference", lambda: loss(reference_label_smoothed_nll_loss)),
        ("loss_fused", lambda: loss(label_smoothed_nll_loss)),
        *[(k, o.step) for k, o in opts.items()],
    ]
    res: dict[str, list[float]] = {}
    for _ in range(a.reps):
        for name, fn in cases:
            t0 = time.perf_counter()
            fn()
            res.setdefault(name, []).append(time.perf_counter() - t0)
    print(f"load {os.getloadavg()}; {sum(p.numel() for p in params) / 1e6:.1f}M parameters")
    for k, v in res.items():
        print(f"{k:<16} median {statistics.median(v) * 1e3:8.1f} ms  (n={len(v)})")


def _ours_for_steps(a: argparse.Namespace):
    """(model in train mode, Adam, batch) of our model for the configuration in ``a``."""
    torch.manual_seed(0)
    model = bm.build_ours(a)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    return model, opt, bm.make_batch(a.batch, a.src, a.tgt, a.vocab)


def _interleaved(names, reps: int):
    """The names once per repetition, the order reversed every other repetition."""
    for r in range(reps):
        yield from list(names)[:: 1 if r % 2 == 0 else -1]


def _ab_steps(a, model, opt, batch, variants: dict, install) -> dict[str, list[float]]:
    """Seconds per model step for each variant: ``install(variant)`` before each timed step,
    ``a.reps`` steps each, interleaved, after one untimed step."""
    bm.train_step(model, opt, batch, False)
    steps: dict[str, list[float]] = {name: [] for name in variants}
    for name in _interleaved(variants, a.reps):
        install(variants[name])
        t0 = time.perf_counter()
        bm.train_step(model, opt, batch, False)
        steps[name].append(time.perf_counter() - t0)
    return steps


def dropout_ab(a: argparse.Namespace) -> None:
    """model/dropout.py against F.dropout: forward + backward on one (B, T, C) activation, then
    whole model steps of ours with each (same process and weights, order alternating)."""
    import torch.nn.functional as F

    from megatron_branchnorm.model import dropout as ours

    fast = ours.dropout
    variants = {"ours": fast, "F.dropout": lambda x, p, training=True: F.dropout(x, p, training)}
    x = torch.randn(a.batch, a.src, a.dim, requires_grad=True)
    g = torch.randn_like(x)
    res: dict[str, list[float]] = {}
    for _ in range(40):
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn(x, a.dropout, True).backward(g)
            res.setdefault(name, []).append(time.perf_counter() - t0)
            x.grad = None

    def install(fn) -> None:
        ours.dropout = fn  # what every Dropout module calls

    steps = _ab_steps(a, *_ours_for_steps(a), variants, install)
    ours.dropout = fast
    print(f"load {os.getloadavg()}")
    for name in variants:
        print(
            f"{name:<10} fwd+bwd {statistics.median(res[name]) * 1e3:6.2f} ms   "
            f"model step {statistics.median(steps[name]):6.3f} s  (n={len(steps[name])})"
        )
    r1 = statistics.median(res["F.dropout"]) / statistics.median(res["ours"])
    r2 = statistics.median(steps["F.dropout"]) / statistics.median(steps["ours"])
    print(f"ours faster: dropout alone {r1:.2f}x, model step {r2:.3f}x")


def compile_ab(a: argparse.Namespace) -> None:
    """The residual block's tail LN(x + alpha * dropout(y)), forward + backward on one (B, T, C)
    activation: eager (our dropout, or F.dropout) against ``torch.compile`` of the same function
    (inductor fuses dropout, add and LayerNorm into generated C++ kernels), with and without
    dropout; compile time reported; same process, order alternating, medians."""
    import torch.nn.functional as F

    from megatron_branchnorm.model.dropout import dropout as ours

    def tail(drop):
        def fn(x, y, w, b):
            z = torch.add(x, drop(y, a.dropout, True), alpha=0.5)
            return F.layer_norm(z, w.shape, w, b, 1e-5)

        return fn

    def plain(x, y, w, b):
        return F.layer_norm(torch.add(x, y, alpha=0.5), w.shape, w, b, 1e-5)

    x = torch.randn(a.batch, a.src, a.dim, requires_grad=True)
    y = torch.randn_like(x, requires_grad=True)
    w = torch.ones(a.dim, requires_grad=True)
    b = torch.zeros(a.dim, requires_grad=True)
    g = torch.randn_like(x)
    variants = {
        "eager, our dropout": tail(ours),
        "eager, F.dropout": tail(lambda t, p, training: F.dropout(t, p, training)),
        "compiled, F.dropout": torch.compile(
            tail(lambda t, p, training: F.dropout(t, p, training))
        ),
        "eager, no dropout": plain,
        "compiled, no dropout": torch.compile(plain),
    }
    for name, fn in variants.items():  # the first call compiles
        t0 = time.perf_counter()
        fn(x, y, w, b).backward(g)
        print(f"{name:<22} first call {time.perf_counter() - t0:6.1f} s")
    res: dict[str, list[float]] = {name: [] for name in variants}
    for name in _interleaved(variants, max(a.reps, 3) * 4):
        t0 = time.perf_counter()
        variants[name](x, y, w, b).backward(g)
        res[name].append(time.perf_counter() - t0)
    print(f"load {os.getloadavg()}; ({a.batch}, {a.src}, {a.dim}), p={a.dropout}")
    for name, v in res.items():
        print(f"{name:<22} fwd+bwd {statistics.median(v) * 1e3:7.2f} ms  (n={len(v)})")
    for kind, ref in (("F.dropout", "eager, our dropout"), ("no dropout", "eager, no dropout")):
        ratio = statistics.median(res[f"compiled, {kind}"]) / statistics.median(res[ref])
        print(f"compiled ({kind}) / {ref}: {ratio:.2f}x the time")


def split_ab(a: argparse.Namespace) -> None:
    """MultiheadAttention._split (the unbind of a permuted view) against slices of the last
    dimension, which save a stack and a copy in the backward: the same values (gradients
    checked bitwise); whole model steps, same process and weights, order alternating, medians.
    Measured 1.000x (docs/performance.md), so the model keeps the unbind."""
    from megatron_branchnorm.model.attention import MultiheadAttention

    def sliced(self, x, n):
        b, t, _ = x.shape
        return [
            z.view(b, t, self.heads, self.head_dim).transpose(1, 2)
            for z in x.split(self.dim, dim=-1)
        ]

    variants = {"unbind": MultiheadAttention._split, "slice": sliced}
    model, opt, batch = _ours_for_steps(a)
    grads = {}
    for name, fn in variants.items():
        MultiheadAttention._split = fn
        torch.manual_seed(1)  # the same dropout masks
        model(batch[0], batch[1]).float().square().mean().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    same = all(torch.equal(x, y) for x, y in zip(*grads.values(), strict=True))

    def install(fn) -> None:
        MultiheadAttention._split = fn

    steps = _ab_steps(a, model, opt, batch, variants, install)
    MultiheadAttention._split = variants["unbind"]
    print(f"load {os.getloadavg()}; {a.layers}L-{a.layers}L; gradients identical: {same}")
    for name, v in steps.items():
        print(f"{name:<8} model step {statistics.median(v):6.3f} s  {[round(x, 2) for x in v]}")
    ratio = statistics.median(steps["unbind"]) / statistics.median(steps["slice"])
    print(f"slice faster: {ratio:.3f}x")


def recompute_ab(a: argparse.Namespace) -> None:
    """The host's time for one encoder and one decoder layer's forward and backward, plain and
    recomputed (``torch.utils.checkpoint``, non-reentrant, as the pipeline's
    ``activation_checkpoint_func``), at a width where the kernels cost next to nothing (d=32, 4
    x 16 tokens): what planner.RECOMPUTE_HOST_FACTOR stands for. Rounds alternate the two ways;
    each round's figure is the fastest of its calls (the least disturbed by other load), and the
    rounds' median is printed."""
    import functools

    from megatron_branchnorm.config import ModelConfig
    from megatron_branchnorm.model.layers import DecoderLayer, EncoderLayer

    m = ModelConfig(hidden_size=32, ffn_hidden_size=128, num_attention_heads=4, vocab_size=64)
    enc, dec = EncoderLayer(m, 1.0, 1.0, 1, 0).train(), DecoderLayer(m, 1.0, 1.0, 1, 0).train()
    x = torch.randn(4, 16, 32, requires_grad=True)
    memory = torch.randn(4, 16, 32, requires_grad=True)
    pad = torch.zeros(4, 16, dtype=torch.bool)
    checkpoint = functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)

    def pair(recompute: bool) -> None:
        run = checkpoint if recompute else (lambda f, *args: f(*args))
        h = run(enc, x, pad)
        run(dec, h, memory, pad).sum().backward()

    calls = 50
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(a.reps):
        for recompute in (False, True):
            best = math.inf
            for _ in range(calls):
                started = time.perf_counter()
                pair(recompute)
                best = min(best, time.perf_counter() - started)
            times[recompute].append(best)
    plain, again = (statistics.median(times[r]) * 1e3 for r in (False, True))
    print(f"load {os.getloadavg()}; {a.reps} rounds of {calls} calls each way")
    print(f"encoder + decoder layer, forward and backward: {plain:.3f} ms plain, {again:.3f} ms "
          f"recomputed: {again / plain:.2f}x")  # fmt: skip


def profile(a: argparse.Namespace) -> None:
    from torch.profiler import profile as prof

    torch.manual_seed(0)
    model = bm.BUILDERS[a.profile](a)
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    batch = bm.make_batch(a.batch, a.src, a.tgt, a.vocab)
    bm.train_step(model, opt, batch, a.bf16)
    with prof() as p:
        bm.train_step(model, opt, batch, a.bf16)
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bm.add_model_args(p)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--profile", choices=bm.IMPLS, default=None)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--dropout-ab", action="store_true", help="our dropout vs F.dropout")
    p.add_argument("--compile-ab", action="store_true", help="residual tail: eager vs compiled")
    p.add_argument("--split-ab", action="store_true", help="attention heads: slice vs unbind")
    p.add_argument("--recompute-ab", action="store_true", help="a layer's host time, recomputed")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    if a.dropout_ab:
        dropout_ab(a)
    elif a.compile_ab:
        compile_ab(a)
    elif a.split_ab:
        split_ab(a)
    elif a.recompute_ab:
        recompute_ab(a)
    elif a.profile:
        profile(a)
    else:
        micro(a)


if __name__ == "__main__":
    main()
