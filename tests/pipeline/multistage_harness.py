"""3 or 4 gloo ranks, started once: every check of pipelines with middle stages.

    RANK=r WORLD_SIZE=3|4 ... python tests/pipeline/multistage_harness.py OUT_DIR

A middle stage both receives activations and receives gradients; with 2 stages there is none.
On WORLD_SIZE ranks (= stages) this runs:

1. parity with the flat model (same weights, one batch as 2 micro-batches, activation
   checkpointing on) for each residual scheme, split by the layouts of PARITY_LAYOUTS, and
   once per layout with bucket shapes (harness.bucket_items: padded micro-batches sent as
   fixed shapes, against the unpadded flat model);
2. Trainer runs of tests/pipeline/test_multistage.py's RUNS for this world size (dropout 0,
   activation checkpointing on, token-based batches of varying shapes), each compared there
   with the one-process run of the same model.

Results go to OUT_DIR/multistage<WORLD_SIZE>.json; the runs' metrics to OUT_DIR/<name>/.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import deepspeed  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron_branchnorm.config import load_config  # noqa: E402
from megatron_branchnorm.training.environment import setup_process_env  # noqa: E402
from megatron_branchnorm.training.trainer import Trainer  # noqa: E402
from tests.pipeline.harness import SCHEMES, parity  # noqa: E402
from tests.pipeline.multistage import PARITY_LAYOUTS, RUNS, run_overrides  # noqa: E402


def main() -> None:
    out_dir = Path(sys.argv[1])
    setup_process_env()
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict = {"parity": {}}
    for layout in PARITY_LAYOUTS[world]:
        for scheme in SCHEMES:
            result: dict = {"parity": {}}
            parity(result, scheme, 1, rank, layout)
            if rank == 0:
                for value in result["parity"].values():
                    out["parity"][f"{scheme}|{layout}"] = value
        result = {"parity": {}}
        parity(result, "branchnorm", 1, rank, layout, buckets=True)
        if rank == 0:
            out["parity"][f"buckets|{layout}"] = result["parity"]["branchnorm_ckpt1_buckets"]
    for name, spec in RUNS.items():
        if spec["world"] == world:
            cfg = load_config("tiny_cpu", run_overrides(name, out_dir))
            Trainer(cfg).train()
    if rank == 0:
        (out_dir / f"multistage{world}.json").write_text(json.dumps(out, indent=1))
    dist.barrier()


if __name__ == "__main__":
    main()
    # Skip the interpreter's teardown, as train.py does (train.exit_now): gloo's threads torn
    # down after Python sometimes abort a rank that has finished ("terminate called without an
    # active exception", exit -6; seen here in a fresh-clone CI run). The results are written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
