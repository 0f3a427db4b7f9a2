"""Test-only fault injection (tests/faults, docs/reliability.md): a no-op unless the
environment variable :data:`FAULT_ENV` is set when the trainer starts.

Comma-separated items:
``nan_loss@T[xN]``: the loss of update T is NaN (its first N attempts; default 1);
``inf_grad@T[xN][:stageS]``: one gradient element on stage S (default the last) is +inf;
``save_exit@POINT[:rankR][:stepN]``: rank R (default 0) calls ``os._exit(FAULT_EXIT_CODE)``
at POINT of the save at step N (default the first save); POINT is one of SAVE_POINTS;
``slow@SECONDS``: sleep before every update (gives a test time to kill a rank mid-run);
``enospc@PHASE[:rankR]``: rank R (default 0) gets ENOSPC ("no space left on device") in PHASE:
``engine`` (its files of a save), ``manifest`` (rank 0's files of a save), ``metrics`` (rank 0's
``metrics.jsonl``).
"""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

from megatron_branchnorm.config import ConfigError
from megatron_branchnorm.training.exit_codes import FAULT_EXIT_CODE

FAULT_ENV = "MBN_FAULT_INJECT"
SAVE_POINTS = ("engine_file", "after_engine", "after_rng", "after_config", "after_manifest")
"""Where a save can be cut: after DeepSpeed's first file of this rank, after DeepSpeed's
save, after the RNG file, after train_config.json, after the manifest (``latest`` not moved)."""


def parse_faults(spec: str) -> dict:
    """The fault items of :data:`FAULT_ENV` (see the module docstring); unknown items are
    errors."""
    faults: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        kind, _, rest = item.partition("@")
        fields = rest.split(":")
        if kind in ("nan_loss", "inf_grad"):
            at, _, times = fields[0].partition("x")
            entry = {"step": int(at), "times": int(times or 1), "stage": None}
            for f in fields[1:]:
                entry["stage"] = int(f.removeprefix("stage"))
            faults[kind] = entry
        elif kind == "save_exit" and fields[0] in SAVE_POINTS:
            entry = {"point": fields[0], "rank": 0, "step": None}
            for f in fields[1:]:
                key = "rank" if f.startswith("rank") else "step"
                entry[key] = int(f.removeprefix(key))
            faults[kind] = entry
        elif kind == "slow":
            faults[kind] = float(rest)
        elif kind == "enospc" and fields[0] in ("engine", "manifest", "metrics"):
            entry = {"phase": fields[0], "rank": 0}
            for f in fields[1:]:
                entry["rank"] = int(f.removeprefix("rank"))
            faults[kind] = entry
        else:
            raise ConfigError(f"{FAULT_ENV}: cannot parse {item!r}")
    return faults


class Faults:
    """The faults this rank was asked to inject; every method does nothing for a fault
    that was not asked for."""

    def __init__(self, rank: int, spec: str | None = None) -> None:
        self.rank = rank
        self.faults = parse_faults(os.environ.get(FAULT_ENV, "") if spec is None else spec)
        self.injected: dict[str, int] = {}
        self.pending_inf = False

    def before_update(self, t: int) -> bool:
        """Called before update ``t``: sleeps for ``slow``, arms ``inf_grad``; True when the
        update's loss must be NaN (``nan_loss``)."""
        if "slow" in self.faults:
            time.sleep(self.faults["slow"])
        nan = self._due("nan_loss", t)
        self.pending_inf = self._due("inf_grad", t)
        return nan

    def _due(self, kind: str, t: int) -> bool:
        f = self.faults.get(kind)
        if f is None or f["step"] != t or self.injected.get(kind, 0) >= f["times"]:
            return False
        self.injected[kind] = self.injected.get(kind, 0) + 1
        return True

    def inject_inf_grad(self, module, stage_id: int, num_stages: int) -> None:
        """Set one gradient element of this stage to +inf when ``inf_grad`` is armed for it
        (called where the gradient norm is computed)."""
        f = self.faults.get("inf_grad")
        if f is None or not self.pending_inf:
            return
        self.pending_inf = False
        stage = num_stages - 1 if f["stage"] is None else f["stage"]
        if stage_id == stage:
            # not a replicated tied copy: the norm counts the tied weight on its first stage
            p = next(
                p
                for p in module.parameters()
                if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
            )
            p.grad.view(-1)[0] = float("inf")

    def exit_in_save(self, point: str, step: int) -> None:
        """``save_exit``: end the process at ``point`` of the save at ``step``."""
        f = self.faults.get("save_exit")
        if f is None or f["point"] != point or f["rank"] != self.rank:
            return
        if f["step"] is None or f["step"] == step:
            print(f"fault injection: exiting at {point} of the save at step {step}", flush=True)
            os._exit(FAULT_EXIT_CODE)

    def fail_in(self, phase: str, path: Path, message: str | None = None) -> None:
        """``enospc``: raise a full disk's OSError for ``path`` in ``phase``."""
        f = self.faults.get("enospc")
        if f is not None and f["phase"] == phase and f["rank"] == self.rank:
            raise OSError(errno.ENOSPC, message or os.strerror(errno.ENOSPC), str(path))
