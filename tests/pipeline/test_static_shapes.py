"""Static shapes through the pipeline (docs/design.md §18): micro-batches padded to fixed
bucket shapes, padding rows included, give the unpadded flat model's loss and gradients at
1 and 2 stages (3 and 4: tests/pipeline/test_multistage.py), and a stage sends DeepSpeed's
shape metadata once per bucket, not once per micro-batch."""

from __future__ import annotations

import json
import re

import pytest

from tests.core.helpers import one_rank_process_group
from tests.pipeline.harness import check_bucket_parity, parity


def test_one_stage_with_buckets_matches_flat_model():
    out: dict = {"parity": {}}
    with one_rank_process_group():
        parity(out, "branchnorm", 1, 0, buckets=True)
    check_bucket_parity(out["parity"]["branchnorm_ckpt1_buckets"], 1)


@pytest.mark.distributed
def test_two_stages_with_buckets_match_flat_model(harness):
    results = json.loads((harness / "harness.json").read_text())["parity"]
    check_bucket_parity(results["branchnorm_ckpt1_buckets"], 2)
    # without buckets (dynamic shapes) the metadata goes with every micro-batch
    assert results["branchnorm_ckpt1"]["metadata_sends"] == [2, 0]
    # the harness's 2-stage Trainer runs (bucket shapes by default) said so at start-up
    log = (harness / "rank0.log").read_text()
    shapes = r"\d+ bucket shapes \(sentences x source x target tokens\): [\dx ]+"
    assert re.search(shapes + r"; padding \d+\.\d% of the tokens of epoch 0's \d+ batches", log)
