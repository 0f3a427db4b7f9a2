"""A preemption signal reaching one rank only (fault 5): every rank stops together,
checkpoints the step it reached, exits with the requeue code, and the restarted run equals the
uninterrupted reference (zero steps lost). The soak in tools/fault_sweep.py repeats this."""

from __future__ import annotations

import pytest

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from tests.faults.common import assert_matches_reference

pytestmark = [pytest.mark.faults, pytest.mark.distributed]


@pytest.mark.parametrize("name", ["usr1_last", "term_first"])
def test_signal_to_one_rank_stops_all_and_loses_no_step(one_rank_signals, name):
    r = one_rank_signals[name]
    assert r["codes"] == [REQUEUE_EXIT_CODE] * 2, r["codes"]
    assert r["tag"] == f"global_step{r['last_step']}"  # the checkpoint holds the last update
    ckpt.verify_checkpoint(one_rank_signals["dir"] / r["tag"])


def test_restart_after_signals_matches_reference(one_rank_signals, fault_harness):
    assert_matches_reference(one_rank_signals["dir"], fault_harness / "ref")


def test_signal_while_starting_requeues_instead_of_killing(early_signals):
    """A SIGUSR1 that reached a rank before the Trainer's handler existed killed it
    (exit 138) and the job was not requeued. train.py records the signal from its first line;
    the trainer acts on it before the first update: every rank exits 75, nothing is saved
    (no update ran since the checkpoint it resumed from), the metrics log is untouched."""
    fresh, done, resumed = (
        early_signals["fresh"],
        early_signals["complete"],
        early_signals["resumed"],
    )
    assert fresh["codes"] == [REQUEUE_EXIT_CODE] * 2, fresh
    assert fresh["latest"] is None and fresh["steps"] == []
    assert done["codes"] == [0, 0] and done["steps"] == [1, 2, 3]
    assert resumed["codes"] == [REQUEUE_EXIT_CODE] * 2, resumed
    assert resumed["latest"] == "global_step3" and resumed["steps"] == [1, 2, 3]
    log = (early_signals["dir"].parent / "resumed" / "rank0.log").read_text()
    assert "signal received before the first update (step 3)" in log
    assert "resumed from" in log
