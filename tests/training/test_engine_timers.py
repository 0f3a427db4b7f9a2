"""DeepSpeed's ``train_batch`` timer does not grow with the updates
(``pipeline.bound_train_batch_timer``, docs/design.md §2).

DeepSpeed 0.19.8's ``PipelineEngine.train_batch`` starts and stops its ``train_batch`` timer
every update; on CUDA each stop keeps two CUDA events in the timer's list, cleared only when
DeepSpeed reads the timer at a ``steps_per_print`` boundary (10**9 here). On the CPU the
accelerator times on the host and records no events, so these tests give DeepSpeed's timer
module an accelerator that times as CUDA does: with device events (a stand-in class that
counts what it makes), everything else the CPU's.
"""

from __future__ import annotations

import time

import pytest
from deepspeed.runtime.pipe.engine import TRAIN_BATCH_TIMER
from deepspeed.utils import timer as ds_timer

from megatron_branchnorm.parallel.pipeline import SummedTrainBatchTimer


class CudaTimedAccelerator:
    """The accelerator as DeepSpeed's timers see it on CUDA: ``use_host_timers()`` is False
    and ``Event`` makes device events (here host clock readings, counted in ``made``); every
    other attribute is the real accelerator's."""

    def __init__(self, real) -> None:  # noqa: ANN001
        self._real = real
        self.made = 0
        owner = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                owner.made += 1
                self.at = 0.0

            def record(self, stream=None) -> None:  # noqa: ANN001, ARG002
                self.at = time.perf_counter()

            def synchronize(self) -> None:
                pass

            def elapsed_time(self, end) -> float:  # noqa: ANN001
                return (end.at - self.at) * 1000.0

        self.Event = Event

    def use_host_timers(self) -> bool:
        return False

    def __getattr__(self, name: str):
        return getattr(self._real, name)


@pytest.fixture
def cuda_timed(monkeypatch: pytest.MonkeyPatch) -> CudaTimedAccelerator:
    """DeepSpeed's timer module sees :class:`CudaTimedAccelerator`."""
    accelerator = CudaTimedAccelerator(ds_timer.get_accelerator())
    monkeypatch.setattr(ds_timer, "get_accelerator", lambda: accelerator)
    return accelerator


def test_the_timer_keeps_one_sum_and_no_event(cuda_timed) -> None:
    timer = SummedTrainBatchTimer(TRAIN_BATCH_TIMER)
    for _ in range(5):
        timer.start()
        timer.stop()
    assert len(timer.event_timers) == 1 and cuda_timed.made == 0
    total = timer.event_timers[0]
    assert timer.elapsed(reset=True) == pytest.approx(total * 1000.0)  # ms, as DeepSpeed's
    assert timer.event_timers == []


@pytest.mark.distributed
def test_train_batch_timer_holds_one_record_after_updates(cuda_timed, monkeypatch) -> None:
    """Three updates through a 1-stage engine with the trainer's engine fixes: DeepSpeed's own
    timer held one pair of device events per update (3 records, 6 events), this one one
    sum, which DeepSpeed's read at a ``steps_per_print`` boundary still gets."""
    import deepspeed

    from tests.core.helpers import one_rank_process_group
    from tests.training.graph_engine import engine_run

    engines = []
    initialize = deepspeed.initialize

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003
        out = initialize(*args, **kwargs)
        engines.append(out[0])
        return out

    monkeypatch.setattr(deepspeed, "initialize", spy)
    with one_rank_process_group():
        run = engine_run("fp32", graphs=False)
    assert len(run["loss"]) == 3 and len(engines) == 1
    timer = engines[0].timers(TRAIN_BATCH_TIMER)
    assert (len(timer.event_timers), cuda_timed.made) == (1, 0)
    assert timer.elapsed(reset=True) > 0 and timer.event_timers == []
