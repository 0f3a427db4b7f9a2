"""Updates through a real DeepSpeed pipeline engine, eager or with each stage's layer ranges
graphed by the trainer's capture on the CPU graph double (tests/training/graph_double.py):
what tests/training/test_cuda_graphs.py runs on one stage and tests/pipeline/harness.py on two
gloo ranks (two stages: micro-batches in flight on stage 0, sends between the stages)."""

from __future__ import annotations

import torch
from torch import nn

from megatron_branchnorm.config import load_config
from megatron_branchnorm.model.residual import set_branch_scale
from megatron_branchnorm.tokens import PAD_ID
from megatron_branchnorm.training import cuda_graphs
from tests.training import graph_double


def fixed_batches(cfg, count: int, rows: int = 4, s: int = 22, t: int = 22) -> list:
    """``count`` engine items of one bucket shape (rows x s x t), each other sentences."""
    from megatron_branchnorm.data.synthetic import SyntheticData, collate

    data = SyntheticData(64, cfg.model.vocab_size, 20)
    items = []
    for i in range(count):
        b = collate(data, list(range(i * rows, (i + 1) * rows)))

        def pad(x, n):
            return nn.functional.pad(x, (0, n - x.shape[1]), value=PAD_ID)

        items.append(
            ((pad(b["src_tokens"], s), pad(b["prev_output_tokens"], t)), pad(b["target"], t))
        )
    return items


def engine_run(
    precision: str,
    graphs: bool,
    handed_over: bool | None = None,
    interval: int = 0,
    stages: int = 1,
    micro_batches: int = 2,
    link_layers: int = 0,
) -> dict:
    """Three updates of ``micro_batches`` micro-batches of one bucket shape through a
    ``stages``-stage engine (lr 0, one rank per stage: run it on that many ranks): each update's
    loss and gradient (norm for bf16, the summed vector for fp32), the ranges installed and the
    stage's DeepSpeed checkpoint interval after install; with ``graphs``, the layer ranges
    replayed from the trainer's own capture factory (install's) on the graph double after
    warm-up, a recomputing stage's in links of ``link_layers`` layers (0: whole ranges)."""
    import deepspeed

    from megatron_branchnorm.parallel.partition import partition_plan
    from megatron_branchnorm.parallel.pipeline import (
        PipeLoss,
        build_pipeline_module,
        install_engine_fixes,
    )
    from megatron_branchnorm.resources import DS_CONFIG_DIR
    from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation
    from megatron_branchnorm.training.ds_config import load_ds_config
    from megatron_branchnorm.training.grad_norm import SkipNonfiniteAdamW

    over = ["model.encoder_layers=2", "model.decoder_layers=2", "model.dropout=0.0",
            f"train.micro_batches={micro_batches}", "train.clip_grad=0.0"]  # fmt: skip
    if precision == "bf16":
        over.append(f"train.deepspeed_config={DS_CONFIG_DIR / 'zero1_bf16.json'}")
    cfg = load_config("tiny_cpu", over)
    torch.manual_seed(0)
    loss_fn = PipeLoss(0.1)
    parts = partition_plan(cfg.model, stages, "balanced")
    module = build_pipeline_module(cfg.model, parts, 1, loss_fn)
    set_branch_scale(module, cfg.model, 3)
    module.set_checkpoint_interval(interval)  # as the trainer does before the engine
    grads: list[torch.Tensor] = []

    class Recording(SkipNonfiniteAdamW):
        def step(self, closure=None):
            grads.append(torch.cat([p.grad.reshape(-1).clone() for p in self._params()]))
            return super().step(closure)

        def _params(self):
            return [p for g in self.param_groups for p in g["params"] if p.grad is not None]

    opt = Recording([p for p in module.parameters() if p.requires_grad], lr=0.0)
    engine, _, _, _ = deepspeed.initialize(
        model=module, optimizer=opt, config=load_ds_config(cfg, 1)
    )
    install_engine_fixes(engine)
    hooks = install_bf16_grad_accumulation(engine)
    ranges: list = []
    handed = hooks and engine.optimizer.immediate_grad_update  # as the trainer computes it
    if graphs:
        ranges = cuda_graphs.install(
            module, "on", device=torch.device("cuda"), bucket_shapes="auto",
            checkpoint_interval=interval, compiled=False,
            grads_handed_over=handed if handed_over is None else handed_over,
            log=lambda _line: None, cuda=graph_double, link_layers=link_layers,
        )  # fmt: skip
    losses, norms = [], []
    batches = fixed_batches(cfg, 3 * micro_batches)
    for update in range(3):
        items = batches[micro_batches * update : micro_batches * (update + 1)]
        loss_fn.scale = micro_batches / sum(int((y != PAD_ID).sum()) for _, y in items)
        losses.append(float(engine.train_batch(data_iter=iter(items))))
        norms.append(float(engine.get_global_grad_norm()) if precision == "bf16" else None)
    return {
        "loss": losses, "norm": norms, "grads": grads, "ranges": ranges, "handed": handed,
        "interval": module.activation_checkpoint_interval,
        "replays": [r.replays for r in ranges], "captures": [r.captures for r in ranges],
        "links": [len(r.links) for r in ranges],
    }  # fmt: skip
