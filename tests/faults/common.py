"""The fault suite's shared pieces: they live in ``megatron_branchnorm.experiments.fault_runs``
(the fault sweep uses them too). TRAIN is train.py's path, for tests that start it directly;
INJECTOR the module a test with a fault starts instead (``python -m INJECTOR``: train.py's main
inside experiments/fault_inject.py)."""

from __future__ import annotations

from megatron_branchnorm.experiments.fault_runs import (
    BASE,
    COMPARED,
    DP_RUN,
    DP_STEPS,
    DP_WORLD,
    EQUIV,
    EQUIV_STEPS,
    INJECTOR,
    STEPS,
    assert_matches_reference,
    handles_signal,
    kill_hard_when,
    kill_tree,
    last_by_step,
    launch,
    max_difference,
    param_hash,
    records,
    signal_at_handler,
    signal_when,
)
from megatron_branchnorm.runner.ranks import wait_ranks as wait_all
from tests.pipeline.conftest import ROOT

TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")

__all__ = [
    "BASE",
    "COMPARED",
    "DP_RUN",
    "DP_STEPS",
    "DP_WORLD",
    "EQUIV",
    "EQUIV_STEPS",
    "INJECTOR",
    "STEPS",
    "TRAIN",
    "assert_matches_reference",
    "handles_signal",
    "kill_hard_when",
    "kill_tree",
    "last_by_step",
    "launch",
    "max_difference",
    "param_hash",
    "records",
    "signal_at_handler",
    "signal_when",
    "wait_all",
]
