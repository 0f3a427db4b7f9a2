"""Kills inside a checkpoint save and kill -9 of one rank mid-run (faults 2, 3)."""

from __future__ import annotations

import pytest

from megatron_branchnorm.experiments.fault_inject import FAULT_EXIT_CODE
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.exit_codes import PEER_LOST_EXIT_CODE
from tests.faults.common import assert_matches_reference
from tests.faults.conftest import RESTARTED, SAVE_KILLS

pytestmark = [pytest.mark.faults, pytest.mark.distributed]

EXIT_BOUND_S = 60.0
"""Every rank must be gone this long after its peer died (measured: a few seconds)."""


@pytest.mark.parametrize("point", sorted(SAVE_KILLS))
def test_kill_inside_save_loads_newest_complete_checkpoint(save_kills, point):
    rank, expected = SAVE_KILLS[point]
    r = save_kills[point]
    assert r["codes"][rank] == FAULT_EXIT_CODE
    assert all(c != 0 for c in r["codes"]), r["codes"]  # the peer fails too, no hang
    assert r["seconds"] < 300  # whole launch incl. start-up; a hang reaches wait_all's 300 s
    assert r["resume_tag"] == expected
    ckpt.verify_checkpoint(r["dir"] / expected)


@pytest.mark.parametrize("point", RESTARTED)
def test_restart_after_killed_saveassert_matches_reference(save_kills, fault_harness, point):
    assert_matches_reference(save_kills[point]["dir"], fault_harness / "ref")


@pytest.mark.parametrize("victim", ["first", "last"])
def test_kill_9_of_one_rank_ends_every_rank(hard_kills, victim):
    seconds, codes = hard_kills[victim]
    assert seconds < EXIT_BOUND_S, seconds
    survivor = codes[1] if victim == "first" else codes[0]
    assert survivor == PEER_LOST_EXIT_CODE, codes
    # one line that says what happened and where to resume from, not gloo's traceback
    log = hard_kills[f"{victim}_survivor_log"]
    assert "Traceback" not in log, log[-3000:]
    lines = [x for x in log.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, log[-3000:]
    assert "another rank, or its node, is gone or stopped answering" in lines[0]
    assert "resubmit the job to resume from" in lines[0] and "global_step" in lines[0]


def test_restart_after_kill_9assert_matches_reference(hard_kills, fault_harness):
    assert hard_kills["resumed_from"], "the second launch did not resume"
    assert_matches_reference(hard_kills["dir"], fault_harness / "ref")
