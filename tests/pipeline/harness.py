"""Two gloo ranks, started once, run every distributed pipeline check and write results.

    RANK=r WORLD_SIZE=2 ... python tests/pipeline/harness.py OUT_DIR

Parity (same weights, same batch): the 2-stage pipeline's loss and gradients vs the flat
model's, for each residual scheme, with activation checkpointing off and on; the batch goes
through the pipeline as 2 micro-batches, and stage 0 (which sends both x_dec and memory) counts
how often backward walks through its first encoder layer. Once more with bucket shapes
(:func:`bucket_items`: 3 micro-batches padded to two fixed shapes, padding rows included, sent
as fixed shapes) against the unpadded flat model. Then three
Trainer runs (2 stages, dropout 0): 20 steps uninterrupted, 10 steps, and a resume to 20.
CUDA graphs across two stages (training/cuda_graphs.py on the CPU graph double,
tests/training/graph_engine.py): 3 bf16 updates of 4 micro-batches (2 in flight on stage 0)
eager, graphed per micro-batch in flight, and graphed recomputing at interval 1.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed
import torch
import torch.distributed as dist

from megatron_branchnorm.config import load_config
from megatron_branchnorm.data.synthetic import SyntheticData, collate
from megatron_branchnorm.model import build_model, label_smoothed_nll_loss
from megatron_branchnorm.model.residual import set_branch_scale
from megatron_branchnorm.parallel.partition import (
    engine_param_to_flat_key,
    partition_plan,
    spec_names,
)
from megatron_branchnorm.parallel.pipeline import (
    PipeLoss,
    build_pipeline_module,
    fixed_shapes,
    install_engine_fixes,
)
from megatron_branchnorm.training.environment import setup_process_env
from megatron_branchnorm.training.grad_norm import SkipNonfiniteAdamW
from megatron_branchnorm.training.trainer import Trainer

SCHEMES = ("branchnorm", "deepnorm", "postln", "preln")
BUCKET_KEYS = [0, 1, 0]
"""The buckets of bucket_items' micro-batches: the first shape comes again (no metadata)."""


def bucket_items(batch: dict) -> list:
    """``batch``'s 8 sentences as 3 micro-batches (3, 3, 2 sentences) padded by
    ``Buckets.pad`` to two fixed shapes, each with padding rows and columns: the first shape
    (4 x S+2 x T+1) for micro-batches 0 and 2, the second (4 x S+4 x T+3) for 1."""
    from megatron_branchnorm.data.buckets import Buckets, LengthHistogram
    from megatron_branchnorm.tokens import PAD_ID

    s, t = batch["src_tokens"].shape[1], batch["target"].shape[1]
    hist = LengthHistogram()
    hist.add(
        (batch["src_tokens"] != PAD_ID).sum(1).numpy(),
        (batch["target"] != PAD_ID).sum(1).numpy(),
        1,
        1,
    )
    buckets = Buckets([(s + 2, t + 1), (s + 4, t + 3)], 4 * (s + 4), hist.weights)
    assert [b.rows for b in buckets.shapes] == [4, 4], buckets.describe()
    items, start = [], 0
    for n, key in zip((3, 3, 2), BUCKET_KEYS, strict=True):
        part = {
            k: batch[k][start : start + n] for k in ("src_tokens", "prev_output_tokens", "target")
        }
        padded = buckets.pad(part, key)
        items.append(((padded["src_tokens"], padded["prev_output_tokens"]), padded["target"]))
        start += n
    return items


def parity(
    out: dict,
    scheme: str,
    ckpt_interval: int,
    rank: int,
    layout: str = "balanced",
    buckets: bool = False,
) -> None:
    """Pipeline (as many stages as ranks, split by ``layout``) vs flat model, one batch; with
    ``buckets``, the pipeline's micro-batches are :func:`bucket_items`' padded ones, sent as
    fixed shapes (``dynamic_shape=False``), and the flat model's batch is not padded."""
    world = dist.get_world_size()
    cfg = load_config(
        "tiny_cpu",
        [
            f"model.residual={scheme}",
            "model.dropout=0.0",
            "model.encoder_layers=3",
            "model.decoder_layers=3",
            "model.branchnorm_steps=8",
        ],
    ).model
    seed, step = 7, 3  # BranchNorm at alpha = 3/8: a non-trivial factor
    parts = partition_plan(cfg, world, layout)
    data = SyntheticData(64, cfg.vocab_size, 20)
    batch = collate(data, list(range(8)))
    loss_fn = PipeLoss(0.1)
    ntokens = batch["ntokens"]
    micro = 3 if buckets else 2
    loss_fn.scale = micro / ntokens  # DeepSpeed averages over micro-batches (PipeLoss)
    module = build_pipeline_module(
        cfg, parts, seed, loss_fn, ckpt_interval, dynamic_shape=not buckets
    )
    set_branch_scale(module, cfg, step)
    grads: dict[str, torch.Tensor] = {}
    names = spec_names(cfg)

    class Capture(SkipNonfiniteAdamW):
        def step(self, closure=None):
            for name, p in module.named_parameters():
                if p.grad is None:
                    continue
                grads[engine_param_to_flat_key(name, names)] = p.grad.detach().clone()

    opt = Capture(module.parameters(), lr=0.0)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro,
        "train_batch_size": micro,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds)
    install_engine_fixes(engine)
    metas = [0]  # DeepSpeed's shape metadata sent by this stage
    send_meta = engine._send_tensor_meta

    def counting_meta(buffer, recv_stage):  # noqa: ANN001
        metas[0] += 1
        return send_meta(buffer, recv_stage)

    engine._send_tensor_meta = counting_meta
    walks = [0]
    if engine.stage_id == 0:  # entry 1 is encoder layer 0
        first = next(p for n, p in module.named_parameters() if n.startswith("1."))
        first.register_post_accumulate_grad_hook(lambda _: walks.__setitem__(0, walks[0] + 1))
    items = [  # two micro-batches of 4 sentences (same padding as the flat model's batch)
        (
            (batch["src_tokens"][i : i + 4], batch["prev_output_tokens"][i : i + 4]),
            batch["target"][i : i + 4],
        )
        for i in (0, 4)
    ]
    if buckets:
        items = bucket_items(batch)
    with fixed_shapes(engine, BUCKET_KEYS if buckets else None):
        loss = float(engine.train_batch(data_iter=iter(items)))  # mean over micro-batches

    flat = build_model(cfg, seed)
    flat.set_step(step)
    logits = flat(batch["src_tokens"], batch["prev_output_tokens"])
    ref_loss, _, _ = label_smoothed_nll_loss(logits, batch["target"], 0.1)
    (ref_loss / ntokens).backward()
    ref = dict(flat.named_parameters())
    worst = 0.0
    for name, g in grads.items():
        r = ref[name].grad
        worst = max(worst, float((g - r).norm() / max(float(r.norm()), 1e-12)))
    key = f"{scheme}_ckpt{ckpt_interval}" + ("_buckets" if buckets else "")
    gathered = [None] * world
    mine = {
        "n": len(grads),
        "worst": worst,
        "walks": walks[0],
        "tied": "embedding.weight" in grads,
        "metas": metas[0],
    }
    dist.all_gather_object(gathered, mine)
    if rank == 0:
        out["parity"][key] = {
            "loss": loss,
            "ref_loss": float(ref_loss.detach() / ntokens),
            "grad_params": sum(g["n"] for g in gathered),
            "embed_copies": sum(g["tied"] for g in gathered),  # stages holding the tied matrix
            "flat_params": len(ref),
            "worst_rel_grad_err": max(g["worst"] for g in gathered),
            "micro_batches": micro,
            "stage0_encoder_walks": gathered[0]["walks"],
            "metadata_sends": [g["metas"] for g in gathered],
        }


def check_bucket_parity(result: dict, stages: int) -> None:
    """What a ``parity(..., buckets=True)`` result must show at ``stages`` stages: the loss and
    gradients of the unpadded flat model (docs/design.md §5), and shape metadata sent once per
    bucket by every stage but the last, not once per micro-batch."""
    assert abs(result["loss"] - result["ref_loss"]) <= 1e-6 * abs(result["ref_loss"]), result
    assert result["worst_rel_grad_err"] <= 1e-5, result
    assert result["grad_params"] == result["flat_params"] + result["embed_copies"] - 1
    assert result["micro_batches"] == len(BUCKET_KEYS)
    assert result["metadata_sends"] == [len(set(BUCKET_KEYS))] * (stages - 1) + [0], result


def trainer_run(workdir: Path, name: str, steps: int, extra: tuple[str, ...] = ()) -> None:
    cfg = load_config(
        "tiny_cpu",
        [
            "pipeline.stages=2",
            "model.dropout=0.0",
            f"train.max_steps={steps}",
            f"train.save_dir={workdir / name}",
            "train.log_interval=1",
            "train.save_interval=10",
            "train.eval_interval=10",
            *extra,
        ],
    )
    Trainer(cfg).train()


def graph_runs() -> dict:
    """Eager and graphed runs of tests/training/graph_engine.engine_run on these 2 ranks as 2
    stages: this rank's losses, gradient norms, replays and captures, gathered by stage."""
    from tests.training.graph_engine import engine_run

    runs = {
        "eager": engine_run("bf16", graphs=False, stages=2, micro_batches=4),
        "in_flight": engine_run("bf16", graphs=True, stages=2, micro_batches=4),
        "eager_ckpt": engine_run("bf16", graphs=False, interval=1, stages=2, micro_batches=4),
        "recompute": engine_run("bf16", graphs=True, interval=1, stages=2, micro_batches=4),
        "links": engine_run(
            "bf16", graphs=True, interval=1, stages=2, micro_batches=4, link_layers=1
        ),
    }
    mine = {
        name: {k: r[k] for k in ("loss", "norm", "replays", "captures", "interval", "links")}
        for name, r in runs.items()
    }
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return {name: [g[name] for g in gathered] for name in runs}


def main() -> None:
    out_dir = Path(sys.argv[1])
    setup_process_env()
    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    out: dict = {"parity": {}}
    for scheme in SCHEMES:
        for interval in (0, 1):
            parity(out, scheme, interval, rank)
    parity(out, "branchnorm", 1, rank, buckets=True)
    out["graphs"] = graph_runs()
    trainer_run(out_dir, "full", 20)
    trainer_run(out_dir, "resume", 10)
    trainer_run(out_dir, "resume", 20)
    # A deep narrow BranchNorm model learns the copy/reverse task (loss must fall): 75
    # updates, 25 of them after BranchNorm's alpha has reached 1 at update 50.
    trainer_run(
        out_dir,
        "learn",
        75,
        (
            "model.encoder_layers=12",
            "model.decoder_layers=12",
            "model.dropout=0.1",
            "train.save_interval=0",
            "train.eval_interval=75",
            "train.log_interval=5",
            "train.warmup_steps=30",
            "train.lr=0.002",
            "model.branchnorm_steps=50",
        ),
    )
    if rank == 0:
        (out_dir / "harness.json").write_text(json.dumps(out, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, as train.py does (train.exit_now): gloo's threads torn
    # down after Python sometimes abort a rank that has finished ("terminate called without an
    # active exception", exit -6; seen here in a fresh-clone CI run). The results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
