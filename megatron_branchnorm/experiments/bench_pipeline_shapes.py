"""Variable batch shapes in DeepSpeed's pipeline: dynamic_shape=True vs fixed bucket shapes.

    python tools/bench_pipeline_shapes.py --steps 30          # starts 2 gloo ranks itself

Token-based micro-batches change shape every step. DeepSpeed caches activation shapes and
receive buffers after the first micro-batch, so either (a) the PipelineModule is built with
``dynamic_shape=True`` (shape metadata is sent, and read on the host, with every micro-batch),
or (b) every micro-batch is padded to one of a few bucket shapes (``data.bucket_shapes``,
data/buckets.py) and the module built with ``dynamic_shape=False``: each stage then sends the
metadata once per bucket (``pipeline.fixed_shapes``), as the trainer does (docs/design.md §18).
Both run the same number of updates of tiny_cpu on 2 stages, each through the trainer's
stream (:class:`TrainStream`); the script prints seconds per update, the ratio (b)/(a)
measured in the same run, the shapes and their padding, and how many metadata messages stage
0 sent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from megatron_branchnorm.runner.ranks import start_ranks

MODULE = "megatron_branchnorm.experiments.bench_pipeline_shapes"
"""What each rank runs: this module (as one of them, :func:`worker`)."""


def worker(args: argparse.Namespace) -> None:
    """One rank: run both modes, rank 0 prints JSON."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.model.residual import set_branch_scale
    from megatron_branchnorm.parallel.partition import partition_plan
    from megatron_branchnorm.parallel.pipeline import (
        PipeLoss,
        build_pipeline_module,
        fixed_shapes,
        install_engine_fixes,
    )
    from megatron_branchnorm.training import collectives
    from megatron_branchnorm.training.data import TrainStream, as_engine_items
    from megatron_branchnorm.training.environment import set_thread_count, setup_process_env

    setup_process_env()
    set_thread_count()
    deepspeed.init_distributed(dist_backend="gloo")
    results: dict = {}
    for mode, shapes in (("dynamic", 0), ("buckets", args.shapes)):
        cfg = load_config(
            "tiny_cpu",
            ["pipeline.stages=2", "model.dropout=0.0", f"data.bucket_shapes={shapes}"],
        )
        gas = cfg.train.micro_batches
        torch.manual_seed(1)
        loss_fn = PipeLoss(0.1)
        module = build_pipeline_module(
            cfg.model, partition_plan(cfg.model, 2), 1, loss_fn, dynamic_shape=(mode == "dynamic")
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
        install_engine_fixes(engine)
        metas = [0]
        send_meta = engine._send_tensor_meta

        def counting(buffer, stage, send_meta=send_meta, metas=metas):  # noqa: ANN001
            metas[0] += 1
            return send_meta(buffer, stage)

        engine._send_tensor_meta = counting
        stream = TrainStream(cfg, 1, 0)  # both stages read data (first and last)
        times = []
        for step in range(args.steps + args.warmup):
            set_branch_scale(module, cfg.model, step + 1)
            update = stream.next_update()
            loss_fn.scale = gas / max(update.target_tokens, 1)
            collectives.barrier()
            t0 = time.perf_counter()
            with fixed_shapes(engine, update.shapes):
                engine.train_batch(data_iter=as_engine_items(update.mine, "cpu"))
            collectives.barrier()
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
        results[mode] = sum(times) / len(times)
        if mode == "buckets":
            results["bucket_shapes"] = stream.describe_buckets()
        results[f"{mode}_metadata_sends"] = metas[0] if engine.is_first_stage() else None
    if dist.get_rank() == 0:
        results["ratio_buckets_over_dynamic"] = results["buckets"] / results["dynamic"]
        print(json.dumps(results))


def main() -> int:
    """Launch 2 ranks of this module, or be one of them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed updates per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed updates per mode")
    parser.add_argument(
        "--shapes", default="auto", help="data.bucket_shapes of mode b (auto or 1 to 64)"
    )
    args = parser.parse_args()
    if "RANK" in os.environ:
        worker(args)
        return 0
    # rank 0's output (its JSON line last) comes through here as it is written; rank 1's
    # goes to a log, shown when it fails
    with tempfile.TemporaryDirectory(prefix="mbn_bench_shapes_") as logs:
        with start_ranks(2, sys.argv[1:], Path(logs), module=MODULE, pipe_rank0=True) as ranks:
            for line in ranks[0].stdout:
                sys.stdout.write(line)
            codes = [p.wait() for p in ranks]
        if codes[1]:
            tail = ranks.logs[1].read_text(encoding="utf-8", errors="replace")[-3000:]
            sys.stderr.write(f"rank 1 exited {codes[1]}:\n{tail}")
    return max(codes)


if __name__ == "__main__":
    sys.exit(main())
