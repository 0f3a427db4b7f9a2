"""pp2 x dp2 on 4 gloo ranks: a preemption signal reaching one data-parallel replica
stops every rank with the requeue code and loses no step, the restarted run equals the
uninterrupted 4-rank run, and the data-parallel split (each replica's share of micro-batches,
the loss normalised over the whole update, ``ids_hash`` over all replicas) computes what one
replica with all the micro-batches computes."""

from __future__ import annotations

import re

import pytest

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from tests.faults.common import (
    DP_STEPS,
    DP_WORLD,
    EQUIV_STEPS,
    assert_matches_reference,
    last_by_step,
)

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

EXIT_BOUND_S = 60.0
"""Every rank must have exited this long after the signal (measured: 2.6 s)."""


def test_sigusr1_to_one_replica_stops_all_four_ranks(dp2_runs):
    out, result = dp2_runs
    assert result["codes"] == [REQUEUE_EXIT_CODE] * DP_WORLD, result["codes"]
    assert result["exit_s"] < EXIT_BOUND_S, result["exit_s"]
    assert 2 <= result["logged"] < DP_STEPS, result["logged"]
    # zero steps lost: the checkpoint holds the last logged update
    assert result["tag"] == ckpt.tag_for(result["logged"])
    manifest = ckpt.verify_checkpoint(out / "usr1" / result["tag"])
    rng = sorted(name for name in manifest["files"] if name.startswith("rng_state"))
    assert rng == [ckpt.rng_file(out, r).name for r in range(DP_WORLD)]


def test_restart_on_four_ranks_matches_reference(dp2_runs):
    out, result = dp2_runs
    tag_dir = out / "usr1" / result["tag"]
    assert f"resumed from {tag_dir} at step" in (out / "restart_logs" / "rank0.log").read_text()
    assert_matches_reference(out / "usr1", out / "ref", steps=DP_STEPS)
    ids = [r["ids_hash"] for r in last_by_step(out / "ref").values()]
    assert len(set(ids)) == DP_STEPS  # every update saw other samples


def test_four_ranks_draw_the_two_rank_stream(dp2_runs, fault_harness):
    """One micro-batch per replica takes the same micro-batches per update as the 2-rank runs'
    two: the sample order does not depend on the topology, and ids_hash covers both replicas."""
    four, two = last_by_step(dp2_runs[0] / "ref"), last_by_step(fault_harness / "ref")
    assert sorted(four) == list(range(1, DP_STEPS + 1))
    for s in four:
        for key in ("ids_hash", "lr", "alpha", "samples"):
            assert four[s][key] == two[s][key], (s, key)


def test_data_parallel_update_equals_one_replica(dp2_runs, fault_harness):
    """Dropout 0: 2 stages x 2 replicas with one micro-batch each against 2 stages x 1 replica
    with both micro-batches. Same loss at update 1 (same weights and samples: each replica
    computed its own share), same gradient norm (the loss normalised per target token of the
    whole update, not per replica), later updates equal up to summation order (docs/design.md §5)."""
    dp, one = last_by_step(dp2_runs[0] / "dp_equiv"), last_by_step(fault_harness / "dp_equiv")
    assert sorted(dp) == sorted(one) == list(range(1, EQUIV_STEPS + 1))
    assert dp[1]["loss"] == pytest.approx(one[1]["loss"], rel=1e-6)
    for s in dp:
        assert dp[s]["ids_hash"] == one[s]["ids_hash"]
        assert dp[s]["lr"] == one[s]["lr"] and dp[s]["alpha"] == one[s]["alpha"]
        for key in ("loss", "nll_loss", "grad_norm"):
            assert dp[s][key] == pytest.approx(one[s][key], rel=1e-4), (s, key)


def test_each_replica_builds_only_its_share(dp2_runs):
    """Each of the 4 ranks (2 stages x 2 replicas) builds the samples of its own
    replica's batches only; the two replicas of a stage read disjoint halves of the epoch."""
    out, _ = dp2_runs
    reads: dict[tuple[int, int], tuple[int, int]] = {}
    for rank in range(DP_WORLD):
        log = (out / "restart_logs" / f"rank{rank}.log").read_text()
        m = re.search(
            rf"rank {rank} \(stage (\d)\): data: epoch \d+ holds (\d+) batches, this rank "
            r"reads (\d+) \(data-parallel rank (\d) of 2",
            log,
        )
        assert m, log[-2000:]
        stage, total, mine, replica = map(int, m.groups())
        reads[(stage, replica)] = (total, mine)
    for stage in (0, 1):
        (total, a), (total_b, b) = reads[(stage, 0)], reads[(stage, 1)]
        assert total == total_b and a + b == total and abs(a - b) <= 2, reads
