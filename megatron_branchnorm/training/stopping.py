"""When a run stops early, agreed by all ranks: a stop signal (SIGUSR1/SIGTERM, recorded by
:mod:`megatron_branchnorm.training.stop_signals`) on any rank, the wall-clock budget, or an error of
one rank alone (a full disk under metrics.jsonl). Every rank takes the same decision after
the same update (on NCCL one update after it was asked: :class:`Stopper`), so no rank waits
for another in a collective (docs/design.md §3, §6.4)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np
import torch

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training import collectives, stop_signals


class TrainError(UserError, RuntimeError):
    """A failure every rank reports the same way (one line, exit 2): a full disk during a
    save, a save_dir held by another run."""


def agree_or_raise(world: int, error: str | None) -> None:
    """Collective: raise :class:`TrainError` on every rank when any rank has an error
    (each rank passes its own, or None), with the first failing rank's message."""
    errors = collectives.all_gather_object(error)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, msg = failed[0]
        where = f" (rank {rank})" if world > 1 else ""
        raise TrainError(f"{msg}{where}")


class Stopper:
    """The stop decision after each update (:meth:`check`) and before the first
    (:meth:`signalled_before_start`). ``local_error`` returns this rank's own error or None;
    ``elapsed`` the seconds trained so far, which the time budget is measured against.

    Reading the agreed flags on the host is a host sync. On gloo (CPU) the all-reduce has
    finished when it returns, so :meth:`check` reads this update's flags at once. On NCCL
    (``deferred``, the default where the communication device is a GPU) it would wait for
    the update's kernels a second time (the first being the optimizer's own read), so
    :meth:`check` sends this update's flags from pinned host memory, copies the result back
    into pinned host memory without blocking, and reads the flags the previous check sent:
    their copy finished before the optimizer's read of this update. A stop is then taken
    one update later than it was asked for, on every rank alike (docs/design.md §3)."""

    def __init__(
        self,
        world: int,
        max_time_minutes: float,
        local_error: Callable[[], str | None],
        elapsed: Callable[[], float],
        deferred: bool | None = None,
    ) -> None:
        self.world = world
        self.budget_min = max_time_minutes
        self.local_error = local_error
        self.elapsed = elapsed  # seconds of training so far (the metrics' clock)
        self.deferred = deferred  # None: decided at the first check (NCCL: True)
        self._buffers: tuple[torch.Tensor, np.ndarray, torch.Tensor, np.ndarray] | None = None
        self._in_flight: tuple[torch.cuda.Event | None, str | None] | None = None

    def _flags(self, time_up: bool) -> tuple[list[float], str | None]:
        """(signal received, time budget spent, this rank failed) as floats, and the error."""
        error = self.local_error()
        flags = [float(stop_signals.received() != 0), float(time_up), float(error is not None)]
        return flags, error

    def _decide(self, flags: Sequence[float], error: str | None) -> tuple[bool, bool]:
        """(signalled, time up) from agreed ``flags``; raises on every rank when one failed."""
        signalled, time_up, failed = flags
        if failed:
            agree_or_raise(self.world, error)
        return bool(signalled), bool(time_up)

    def _agree(self, time_up: bool) -> tuple[bool, bool]:
        """(a stop signal reached some rank, the time budget is spent), agreed by all ranks
        now; a rank's own error makes every rank raise it."""
        flags, error = self._flags(time_up)
        return self._decide(collectives.to_host(collectives.all_reduce(flags, op="max")), error)

    def _agree_previous(self, time_up: bool) -> tuple[bool, bool]:
        """The deferred :meth:`_agree`: the flags agreed at the previous check ((False, False)
        at the first), after sending this check's unless they stop the run."""
        device = collectives.communication_device()
        if self._buffers is None:
            pinned = device.type == "cuda"
            send = torch.zeros(3, dtype=torch.float64, pin_memory=pinned)
            host = torch.zeros(3, dtype=torch.float64, pin_memory=pinned)
            # numpy views of the host buffers, made once: reading them is a read of host memory
            self._buffers = (send, send.numpy(), host, host.numpy())
        send, send_view, host, host_view = self._buffers
        previous = (False, False)
        if self._in_flight is not None:
            done, error = self._in_flight
            self._in_flight = None
            if done is not None:
                done.synchronize()  # recorded before this update's kernels: already complete
            previous = self._decide(host_view.tolist(), error)
            if any(previous):
                return previous
        flags, error = self._flags(time_up)
        send_view[:] = flags  # its previous copy to the device is complete (the event above)
        reduced = collectives.all_reduce(send, op="max")  # one copy to the device, no wait
        host.copy_(reduced, non_blocking=device.type == "cuda")
        done = None
        if device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        self._in_flight = (done, error)
        return previous

    def settle(self) -> None:
        """At the end of the loop, however it ended (every rank ends it at the same update):
        a rank's error that a deferred check has not agreed on yet (one of the last update)
        is raised on every rank now, never lost to an exit 0. Nothing to do when each check
        agreed at once."""
        if self.deferred:
            self._in_flight = None  # the last flags sent are superseded by this agreement
            self._agree(False)

    def signalled_before_start(self) -> bool:
        """A signal came while the ranks were starting (it is forgotten: nothing was trained
        since the checkpoint the run resumed from, so there is nothing to save)."""
        if self._agree(False)[0]:
            stop_signals.clear()
            return True
        return False

    def check(self) -> str | None:
        """After an update: ``"signal"``, ``"time"`` or None (train on); deferred, on the
        flags the previous check sent (class docstring)."""
        if self.deferred is None:
            self.deferred = collectives.communication_device().type == "cuda"
        time_up = bool(self.budget_min) and self.elapsed() >= self.budget_min * 60
        agree = self._agree_previous if self.deferred else self._agree
        signalled, time_up = agree(time_up)
        if signalled:
            stop_signals.clear()
            return "signal"
        return "time" if time_up else None


class NonfiniteSkips:
    """Updates skipped for a non-finite gradient norm: each is a metrics row and a console
    line; in fp32, train.max_consecutive_skips in a row stop the run (exit
    NONFINITE_EXIT_CODE, no save). In fp16 DeepSpeed's loss scaler lowers the scale and
    retries, so skips never stop the run."""

    def __init__(self, limit: int, fp32: bool, save_dir, metrics, is_logger: bool) -> None:
        self.limit, self.fp32, self.save_dir = limit, fp32, save_dir
        self.metrics, self.is_logger = metrics, is_logger
        self.skipped_steps = 0  # in this process, the metrics' ``skipped_steps``
        self.consecutive_skips = 0  # since the last applied update

    def applied(self) -> None:
        """An update was applied: the run of skips ends."""
        self.consecutive_skips = 0

    def stop_after_skip(
        self, *, update: int, applied_updates: int, where, loss_scale: float, ids_hash: str
    ) -> bool:
        """Record that the update tried as number ``update`` (``applied_updates`` + 1: skips
        do not advance it) was skipped, ``applied_updates`` updates having been applied;
        ``where`` is (stage, module) of the first non-finite gradient when known. True when
        the run must stop."""
        self.skipped_steps += 1
        self.consecutive_skips += 1
        stage, module = where if where else (None, None)
        self.metrics.write(
            {
                "step": applied_updates,
                "skipped": True,
                "update": update,
                "consecutive_skips": self.consecutive_skips,
                "skipped_steps": self.skipped_steps,
                "first_nonfinite_stage": stage,
                "first_nonfinite_module": module,
                "loss_scale": loss_scale,  # after the skip: fp16 lowered it
                "ids_hash": ids_hash,
            }
        )
        what = f"first non-finite gradient in {module} (stage {stage})" if where else "overflow"
        self.metrics.log(
            f"update {update} skipped at step {applied_updates}: non-finite gradient norm; "
            f"{what}; {self.consecutive_skips} consecutive, {self.skipped_steps} in total"
        )
        if not self.fp32 or self.consecutive_skips < self.limit:
            return False
        latest = ckpt.read_latest(self.save_dir)
        msg = (
            f"error: stopping: {self.consecutive_skips} consecutive updates with a non-finite "
            f"gradient norm (train.max_consecutive_skips={self.limit}) at step "
            f"{applied_updates}; {what}; the last "
            f"good checkpoint is {self.save_dir / latest if latest else 'none'}"
        )
        if self.is_logger:
            print(msg, file=sys.stderr, flush=True)
        return True
