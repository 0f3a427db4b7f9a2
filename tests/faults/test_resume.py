"""Golden resume and non-finite updates, from the shared fault harness (faults 1, 6)."""

from __future__ import annotations

import json

import pytest

from tests.faults.common import COMPARED, STEPS, last_by_step, param_hash, records

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


def test_golden_resume_is_exact(fault_harness):
    """Save at 6, new Trainer, resume to 12: every record and the final weights equal the
    uninterrupted run's (dropout 0.1 and activation checkpointing on)."""
    ref, res = fault_harness / "ref", fault_harness / "resume"
    rows = records(res)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    full = last_by_step(ref)
    for r in rows:
        for key in COMPARED:
            assert r[key] == full[r["step"]][key], (r["step"], key)
    assert len({r["ids_hash"] for r in rows}) == STEPS  # every update saw other samples
    tag = f"global_step{STEPS}"
    assert param_hash(res / tag) == param_hash(ref / tag)


def test_nonfinite_update_is_skipped_and_logged(fault_harness):
    """NaN loss at update 3, Inf gradient on stage 0 at update 5: both skipped on every stage,
    the LR not stepped, the step counter not advanced, each skip logged with step and stage."""
    result = json.loads((fault_harness / "harness.json").read_text())["skip"]
    assert [r["engine_skipped"] for r in result] == [2, 2] and [r["code"] for r in result] == [0, 0]
    lines = [json.loads(x) for x in (fault_harness / "skip" / "metrics.jsonl").open()]
    skips = [r for r in lines if r.get("skipped")]
    assert [(s["update"], s["step"]) for s in skips] == [(3, 2), (5, 4)]
    assert all(s["first_nonfinite_stage"] == 0 and s["first_nonfinite_module"] for s in skips)
    applied = [r for r in lines if "loss" in r]
    assert [r["step"] for r in applied] == list(range(1, 7))
    ref = last_by_step(fault_harness / "ref")
    # the LR and alpha follow applied updates, not attempts
    assert [r["lr"] for r in applied] == [ref[s]["lr"] for s in range(1, 7)]
    assert [r["alpha"] for r in applied] == [ref[s]["alpha"] for s in range(1, 7)]
    assert applied[-1]["skipped_steps"] == 2


def test_consecutive_nonfinite_updates_stop_the_run(fault_harness):
    """Three Inf gradients in a row with max_consecutive_skips=3: exit code 3 on both ranks,
    parameters, Adam moments and LR bit-identical to the last good state, no new checkpoint."""
    result = json.loads((fault_harness / "harness.json").read_text())["stop"]
    for r in result:
        assert r["code"] == 3 and r["engine_skipped"] == 3, r
        assert r["params"] and r["moments"] and r["lr"] and r["step"], r
    stop = fault_harness / "stop"
    assert (stop / "latest").read_text() == "global_step3"
    assert sorted(p.name for p in stop.glob("global_step*")) == ["global_step3"]
    log = (fault_harness / "rank0.log").read_text()
    assert "error: stopping: 3 consecutive updates with a non-finite gradient norm" in log
    assert "first non-finite gradient in decoder" in log
    assert f"last good checkpoint is {stop / 'global_step3'}" in log
