"""What a CUDA graph's memory pool must hold: the live peak of what a link's forward and
``torch.autograd.grad`` backward allocate, against the planner's pool for that link
(docs/performance.md, "What a pool holds beside the activations"; docs/design.md §19).

    python -m megatron_branchnorm.experiments.graph_pool          # d=512, FFN 2048, 4,096 tokens

A capture allocates in its pool every tensor its forward and backward make
(training/graph_capture.py), so the pool needs the live peak of those, not only the
activations the forward keeps. The count is made on the CPU by
:class:`~megatron_branchnorm.experiments.launches.LaunchCounter` (the bytes of the storages
allocated inside it while they live): the same tensors a GPU capture allocates, without the
allocator's rounding. The output gradient is made outside, as a capture reads it from a buffer
outside the pool.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from megatron_branchnorm.config import ModelConfig, load_config


def model_config(d: int, ffn: int, heads: int, dropout: float, layers: int = 8) -> ModelConfig:
    """tiny_cpu's model at this width, with ``layers`` encoder and decoder layers."""
    return load_config(
        "tiny_cpu",
        [f"model.hidden_size={d}", f"model.ffn_hidden_size={ffn}",
         f"model.num_attention_heads={heads}", f"model.dropout={dropout}",
         f"model.encoder_layers={layers}", f"model.decoder_layers={layers}"],
    ).model  # fmt: skip


def link_peak(
    m: ModelConfig, kind: str, layers: int, rows: int, length: int, dtype: torch.dtype
) -> int:
    """Live peak bytes of what a link of ``layers`` encoder (``kind`` "enc") or decoder layers
    allocates in its training forward and backward (inputs' and weights' gradients) on a batch
    of ``rows`` x ``length`` tokens, in ``dtype``. ``layers`` must be fewer than the model's
    (its last decoder layer returns the hidden states alone)."""
    from megatron_branchnorm.experiments.launches import LaunchCounter
    from megatron_branchnorm.model.residual import stack_constants
    from megatron_branchnorm.parallel.pipeline import DecoderLayerPipe, EncoderLayerPipe
    from megatron_branchnorm.training.cuda_graphs import LayerRun

    (ea, eb), (da, db) = stack_constants(m)
    torch.manual_seed(0)
    if kind == "enc":
        made = [EncoderLayerPipe(m, ea, eb, 1, i) for i in range(layers)]
    else:
        made = [DecoderLayerPipe(m, da, db, 1, i) for i in range(layers)]
    run = LayerRun(made, as_tuple=True).to(dtype).train()
    d = m.hidden_size
    x = torch.randn(rows, length, d, dtype=dtype, requires_grad=True)
    ids = torch.randint(4, m.vocab_size, (rows, length))
    memory = torch.randn(rows, length, d, dtype=dtype, requires_grad=True)
    args, wrt = ((x, ids, ids.clone()), [x]) if kind == "enc" else ((x, memory, ids), [x, memory])
    grad_out = torch.randn(rows, length, d, dtype=dtype)
    counter = LaunchCounter()
    with counter:
        out = run(*args)
        grads = torch.autograd.grad(out, [*wrt, *run.parameters()], grad_out)
        del out, grads
    return counter.peak_bytes


def planned_pool(
    m: ModelConfig, kind: str, layers: int, tokens: int, act_bytes: int, work: bool = True
) -> float:
    """The planner's pool for that link (``RunPlan._pool``): its layers' activations and, with
    ``work``, the backward's working set (``planner.capture_work``; without: the pool as
    planned before 2026-11-28)."""
    from megatron_branchnorm.parallel.planner import (
        ALLOCATOR_MARGIN,
        DEC_ACT_BYTES,
        ENC_ACT_BYTES,
        GB,
        RunPlan,
        capture_work,
        layer_activation_bytes,
        plan_run,
    )

    per_token = ENC_ACT_BYTES if kind == "enc" else DEC_ACT_BYTES
    per_layer = tokens * layer_activation_bytes(m, per_token, act_bytes) * ALLOCATOR_MARGIN
    stage = dataclasses.replace(
        plan_run(load_config("tiny_cpu"), 1, 80 * GB).stage_plans[0],
        graph_links=((layers, per_layer, 0.0),),
        capture_work=capture_work(m, tokens, act_bytes) if work else 0.0,
    )
    return RunPlan._pool(stage, 0)


LINKS = (("enc", 1), ("enc", 2), ("enc", 4), ("dec", 1), ("dec", 8))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--ffn", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--dropout", type=float, default=0.1)
    a = p.parse_args(argv)
    m = model_config(a.hidden, a.ffn, a.heads, a.dropout, layers=9)
    tokens = a.rows * a.length
    print(f"d={a.hidden}, FFN {a.ffn}, {a.heads} heads, {tokens:,} tokens ({a.rows} x "
          f"{a.length}), bf16, dropout {a.dropout}; torch {torch.__version__}\n")  # fmt: skip
    print("| link | measured live peak | planner before | planner now |")
    print("| --- | ---: | ---: | ---: |")
    for kind, layers in LINKS:
        peak = link_peak(m, kind, layers, a.rows, a.length, torch.bfloat16)
        before = planned_pool(m, kind, layers, tokens, 2, work=False)
        now = planned_pool(m, kind, layers, tokens, 2)
        what = f"{layers} {'encoder' if kind == 'enc' else 'decoder'} layer{'s' * (layers > 1)}"
        print(f"| {what} | {peak / 2**20:.1f} MiB | {before / 2**20:.1f} MiB (the peak "
              f"{peak / before:.2f}x it) | {now / 2**20:.1f} MiB |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
