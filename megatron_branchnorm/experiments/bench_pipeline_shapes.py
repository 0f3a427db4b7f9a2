"""Variable batch shapes in DeepSpeed's pipeline: dynamic_shape=True vs fixed bucket shapes.

    python tools/bench_pipeline_shapes.py --steps 30          # starts 2 gloo ranks itself

Token-based micro-batches change shape every step. DeepSpeed caches activation shapes and
receive buffers after the first micro-batch, so either (a) the PipelineModule is built with
``dynamic_shape=True`` (shape metadata is sent with every micro-batch), or (b) every
micro-batch is padded to one of a few bucket shapes (length rounded up to a multiple of
--bucket, rows to max_tokens // length) and ``engine.reset_activation_shape()`` is called
whenever the shape changes. Both run the same updates of tiny_cpu on 2 stages; the script
prints seconds per update and the ratio (b)/(a), measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from megatron_branchnorm.launch import free_port


def _pad(batch: dict, bucket: int, max_tokens: int) -> dict:
    import torch

    from megatron_branchnorm.tokens import PAD_ID

    length = max(batch["src_tokens"].shape[1], batch["target"].shape[1])
    length = -(-length // bucket) * bucket
    rows = max(max_tokens // length, batch["src_tokens"].shape[0])
    out = {}
    for key in ("src_tokens", "prev_output_tokens", "target"):
        t = batch[key]
        padded = torch.full((rows, length), PAD_ID, dtype=t.dtype)
        padded[: t.shape[0], : t.shape[1]] = t
        out[key] = padded
    return out


def worker(args: argparse.Namespace) -> None:
    """One rank: run both modes, rank 0 prints JSON."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.model.residual import set_branch_scale
    from megatron_branchnorm.partition import partition_plan
    from megatron_branchnorm.pipeline import PipeLoss, build_pipeline_module
    from megatron_branchnorm.synthetic import SyntheticBatches, SyntheticData
    from megatron_branchnorm.training import collectives
    from megatron_branchnorm.training.environment import set_thread_count, setup_process_env

    setup_process_env()
    set_thread_count()
    deepspeed.init_distributed(dist_backend="gloo")
    cfg = load_config("tiny_cpu", ["pipeline.stages=2", "model.dropout=0.0"])
    parts = partition_plan(cfg.model, 2)
    gas = cfg.train.micro_batches
    results = {}
    for mode in ("dynamic", "buckets"):
        torch.manual_seed(1)
        loss_fn = PipeLoss(0.1)
        module = build_pipeline_module(
            cfg.model, parts, 1, loss_fn, dynamic_shape=(mode == "dynamic")
        )
        opt = torch.optim.AdamW(module.parameters(), lr=1e-4)
        ds = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_accumulation_steps": gas,
            "train_batch_size": gas,
            "gradient_clipping": 0.0,
            "steps_per_print": 10**9,
        }
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds)
        data = SyntheticData(4000, cfg.model.vocab_size, cfg.data.max_length)
        it = iter(SyntheticBatches(data, cfg.data.max_tokens, seed=1))
        shape = None
        times = []
        for step in range(args.steps + args.warmup):
            set_branch_scale(module, cfg.model, step + 1)
            batches = [next(it) for _ in range(gas)]
            ntok = sum(b["ntokens"] for b in batches)
            loss_fn.scale = gas / ntok
            if mode == "buckets":
                batches = [_pad(b, args.bucket, cfg.data.max_tokens) for b in batches]
                shapes = {tuple(b["src_tokens"].shape) for b in batches}
                new = shapes.pop() if len(shapes) == 1 else None
                if new is None or new != shape:
                    engine.reset_activation_shape()
                shape = new
                if new is None:  # micro-batches of one update differ: pad to the largest
                    rows = max(b["src_tokens"].shape[0] for b in batches)
                    length = max(b["src_tokens"].shape[1] for b in batches)
                    batches = [_pad(b, length, rows * length) for b in batches]
            items = [((b["src_tokens"], b["prev_output_tokens"]), b["target"]) for b in batches]
            collectives.barrier()
            t0 = time.perf_counter()
            engine.train_batch(data_iter=iter(items))
            collectives.barrier()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        results[mode] = sum(times) / len(times)
    if dist.get_rank() == 0:
        results["ratio_buckets_over_dynamic"] = results["buckets"] / results["dynamic"]
        print(json.dumps(results))


def main() -> int:
    """Launch 2 ranks of this module, or be one of them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed updates per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates per mode")
    parser.add_argument("--bucket", type=int, default=8, help="length rounding (mode b)")
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    port = free_port()
    me = [sys.executable, "-m", "megatron_branchnorm.experiments.bench_pipeline_shapes"]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE="2",
            LOCAL_RANK=str(rank),
            LOCAL_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [*me, *sys.argv[1:]], env=env, stderr=subprocess.DEVNULL if rank else None
            )
        )
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
