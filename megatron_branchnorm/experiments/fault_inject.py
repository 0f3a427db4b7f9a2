"""Test-only fault injection around the real trainer (tests/faults, tools/fault_sweep.py,
docs/reliability.md). The trainer holds no hook for it: this module patches around the working
code, then runs ``megatron_branchnorm.train``'s main exactly as train.py does.

    MBN_FAULT_INJECT=nan_loss@3 deepspeed --num_gpus 2 --module \\
        megatron_branchnorm.experiments.fault_inject --config tiny_cpu pipeline.stages=2
    MBN_FAULT_INJECT=slow@0.5 python -m megatron_branchnorm.experiments.fault_inject --config ...

The faults, comma-separated items of :data:`FAULT_ENV`:
``nan_loss@T[xN]``: the loss of update T is NaN (its first N attempts; default 1);
``inf_grad@T[xN][:stageS]``: one gradient element on stage S (default the last) is +inf;
``save_exit@POINT[:rankR][:stepN]``: rank R (default 0) calls ``os._exit(FAULT_EXIT_CODE)``
at POINT of the save at step N (default the first save); POINT is one of :data:`SAVE_POINTS`;
``save_interrupt@POINT[:rankR][:stepN]``: the same place raises KeyboardInterrupt (Ctrl-C);
``slow@SECONDS``: sleep before every update (gives a test time to kill a rank mid-run);
``hold@PATH``: before every update after the first, wait until PATH exists or a stop signal
is recorded (a test holds a run mid-training for as long as it needs, and lets it go on by
creating PATH; a held run stops on SIGTERM as an unheld one does);
``enospc@PHASE[:rankR]``: rank R (default 0) gets ENOSPC ("no space left on device") in PHASE:
``engine`` (its files of a save), ``manifest`` (rank 0's files of a save), ``metrics`` (a row
of rank 0's ``metrics.jsonl``).

With :data:`FP16_ON_CPU_ENV` set to ``1``, DeepSpeed's CPU accelerator also reports fp16 as
supported (docs/design.md §7: what that emulation proves and what only a GPU can).

In one process, :func:`injecting` installs a spec around a block (tests/faults/harness.py
builds and trains its Trainers inside it) and takes the patches off again.
"""

from __future__ import annotations

from megatron_branchnorm.training import stop_signals

if __name__ == "__main__":  # first of all, as train.py: a SIGUSR1/SIGTERM is recorded, not fatal
    stop_signals.install()

import contextlib  # noqa: E402
import errno  # noqa: E402
import functools  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
from collections.abc import Callable, Iterator  # noqa: E402

from megatron_branchnorm.config import ConfigError  # noqa: E402

FAULT_ENV = "MBN_FAULT_INJECT"
FP16_ON_CPU_ENV = "MBN_TEST_FP16_ON_CPU"
FAULT_EXIT_CODE = 86
"""The exit code of a rank ended by ``save_exit``."""
"""With ``1``: DeepSpeed's CPU accelerator reports fp16 as supported, so the fp16 engine path
(DeepSpeed's ZeRO-1 optimizer with dynamic loss scaling) runs on CPU ranks in the test suite.
Never for a real run: on most CPUs fp16 compute is emulated and slow."""
SAVE_POINTS = ("engine_file", "after_engine", "after_rng", "after_config", "after_manifest")
"""Where a save can be cut: after DeepSpeed's first file of this rank, after DeepSpeed's
save, after the RNG file, after train_config.json, after the manifest (``latest`` not moved)."""
EXIT_BAD_INPUT = 2


def parse_faults(spec: str) -> dict:
    """The fault items of :data:`FAULT_ENV` (see the module docstring); unknown items are
    errors (a one-line ConfigError)."""
    faults: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        kind, _, rest = item.partition("@")
        fields = rest.split(":")
        try:
            if kind in ("nan_loss", "inf_grad"):
                at, _, times = fields[0].partition("x")
                entry = {"step": int(at), "times": int(times or 1), "stage": None}
                for f in fields[1:]:
                    entry["stage"] = int(f.removeprefix("stage"))
                faults[kind] = entry
            elif kind in ("save_exit", "save_interrupt") and fields[0] in SAVE_POINTS:
                entry = {"point": fields[0], "rank": 0, "step": None}
                for f in fields[1:]:
                    key = "rank" if f.startswith("rank") else "step"
                    entry[key] = int(f.removeprefix(key))
                faults[kind] = entry
            elif kind == "slow":
                faults[kind] = float(rest)
            elif kind == "hold" and rest:
                faults[kind] = rest
            elif kind == "enospc" and fields[0] in ("engine", "manifest", "metrics"):
                entry = {"phase": fields[0], "rank": 0}
                for f in fields[1:]:
                    entry["rank"] = int(f.removeprefix("rank"))
                faults[kind] = entry
            else:
                raise ValueError(item)
        except ValueError:
            raise ConfigError(f"{FAULT_ENV}: cannot parse {item!r}") from None
    return faults


def emulate_fp16_on_cpu() -> bool:
    """Make DeepSpeed's CPU accelerator report fp16 as supported (:data:`FP16_ON_CPU_ENV`);
    True when applied (False on another accelerator)."""
    import torch
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu":
        return False
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    return True


class Injector:
    """The faults of one spec, installed by patching around the trainer's code
    (:meth:`install`, :meth:`uninstall`). Where each lands:

    - ``slow``, ``hold``, ``nan_loss``, ``inf_grad`` (armed): around ``Trainer._update``; ``nan_loss``
      sets the loss function's scale to NaN as the update's ``engine.train_batch`` starts;
    - ``inf_grad``: ``grad_norm.pipeline_grad_norm`` (the fp32 all-stage norm) first sets one
      gradient element of the stage to +inf;
    - ``save_exit`` and ``enospc@engine|manifest``: around ``Checkpointer.save`` (the save in
      progress), the engine's ``save_checkpoint`` (after_engine) and its checkpoint engine's
      ``save`` (engine_file, enospc@engine), ``torch.save`` outside DeepSpeed's save (the
      RNG file: after_rng) and the manifest writer (after_config before it, after_manifest
      after it, enospc@manifest instead of it);
    - ``enospc@metrics``: the row writer ``write_row`` of the metrics writer, inside its guard
      (a full disk fails the write, as a real one does, after the file opened).

    Every patch replaces an attribute the code has (:meth:`_patch` refuses a missing one): a
    renamed method fails the fault suite instead of turning its faults into no-ops.
    """

    def __init__(self, faults: dict) -> None:
        self.faults = faults
        self.injected: dict[str, int] = {}
        self.pending_inf = False
        self.trainer = None  # the Trainer whose update is running
        self.saving = None  # the Checkpointer whose save is running
        self.in_engine_save = False
        self._undo: list[Callable[[], None]] = []

    # ---- when ----------------------------------------------------------------------------

    def _due(self, kind: str, t: int) -> bool:
        f = self.faults.get(kind)
        if f is None or f["step"] != t or self.injected.get(kind, 0) >= f["times"]:
            return False
        self.injected[kind] = self.injected.get(kind, 0) + 1
        return True

    def _exit_at(self, point: str) -> None:
        """``save_exit``: end the process at ``point`` of the save in progress;
        ``save_interrupt``: raise KeyboardInterrupt there (Ctrl-C)."""
        for kind in ("save_exit", "save_interrupt"):
            f, saving = self.faults.get(kind), self.saving
            if f is None or saving is None or f["point"] != point or f["rank"] != saving.rank:
                continue
            step = saving.state.step
            if f["step"] is not None and f["step"] != step:
                continue
            if kind == "save_interrupt":
                raise KeyboardInterrupt
            print(f"fault injection: exiting at {point} of the save at step {step}", flush=True)
            os._exit(FAULT_EXIT_CODE)

    def _full_disk(self, phase: str, rank: int, path, message: str | None = None) -> None:
        """``enospc``: raise a full disk's OSError for ``path`` in ``phase``."""
        f = self.faults.get("enospc")
        if f is not None and f["phase"] == phase and f["rank"] == rank:
            raise OSError(errno.ENOSPC, message or os.strerror(errno.ENOSPC), str(path))

    # ---- patches -------------------------------------------------------------------------

    def _patch(self, owner, name: str, make: Callable) -> None:
        """Replace ``owner.name`` by ``make(original)``; :meth:`uninstall` puts it back.

        ``owner.name`` must exist: creating it would leave the code calling what it always
        called, so a renamed ``Trainer._update`` would make every fault test pass without a
        fault. A missing attribute is an AttributeError naming the owner and the name. A
        method a class inherits is patched on the class and deleted again by uninstall."""
        if not hasattr(owner, name):
            raise AttributeError(
                f"fault injection: {_owner_name(owner)} has no attribute {name!r} to patch "
                "(renamed or moved? the fault would never fire)"
            )
        if isinstance(owner, type) and name in owner.__dict__:
            original, inherited = owner.__dict__[name], False  # a descriptor kept as it is
        else:
            original, inherited = getattr(owner, name), isinstance(owner, type)
        setattr(owner, name, make(original))
        if inherited:
            self._undo.append(lambda: delattr(owner, name))
        else:
            self._undo.append(lambda: setattr(owner, name, original))

    def install(self) -> Injector:
        """Patch what the spec needs (nothing for an empty spec); a patch that fails takes
        the ones made before it off again, then raises."""
        if not self.faults:
            return self
        try:
            self._install()
        except BaseException:
            self.uninstall()
            raise
        return self

    def _install(self) -> None:
        import torch

        from megatron_branchnorm.training import checkpointer, grad_norm, metrics, trainer

        self._patch(trainer.Trainer, "_update", self._wrap_update)
        if "inf_grad" in self.faults:
            self._patch(grad_norm, "pipeline_grad_norm", self._wrap_grad_norm)
        if {"save_exit", "save_interrupt", "enospc"} & self.faults.keys():
            self._patch(checkpointer.Checkpointer, "save", self._wrap_save)
            self._patch(torch, "save", self._wrap_torch_save)
            self._patch(checkpointer.ckpt, "write_manifest", self._wrap_write_manifest)
        if self.faults.get("enospc", {}).get("phase") == "metrics":
            self._patch(metrics, "write_row", self._wrap_write_row)

    def uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap_update(self, update: Callable) -> Callable:
        injector = self

        @functools.wraps(update)
        def _update(trainer, t: int):
            if "slow" in injector.faults:
                time.sleep(injector.faults["slow"])
            if "hold" in injector.faults and t > 1:
                # a poll of the test's event; a stop signal ends the wait too, so that the
                # update runs and the trainer stops after it as it would unheld
                while not os.path.exists(injector.faults["hold"]) and not stop_signals.received():
                    time.sleep(0.05)
            nan = injector._due("nan_loss", t)
            injector.pending_inf = injector._due("inf_grad", t)
            injector.trainer = trainer
            if not nan:
                return update(trainer, t)
            engine = trainer.engine
            train_batch = engine.train_batch

            def nan_train_batch(*args, **kwargs):
                trainer.loss_fn.scale = float("nan")
                return train_batch(*args, **kwargs)

            engine.train_batch = nan_train_batch
            try:
                return update(trainer, t)
            finally:
                del engine.train_batch

        return _update

    def _wrap_grad_norm(self, pipeline_grad_norm: Callable) -> Callable:
        injector = self

        @functools.wraps(pipeline_grad_norm)
        def norm(module, group):
            trainer = injector.trainer
            if injector.pending_inf and trainer is not None:
                injector.pending_inf = False
                stage = injector.faults["inf_grad"]["stage"]
                stage = trainer.engine.num_stages - 1 if stage is None else stage
                if trainer.stage_id == stage:
                    # not a replicated tied copy: the norm counts the tied weight on its first stage
                    p = next(
                        p
                        for p in module.parameters()
                        if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
                    )
                    p.grad.view(-1)[0] = float("inf")
            return pipeline_grad_norm(module, group)

        return norm

    def _wrap_save(self, save: Callable) -> Callable:
        injector = self

        @functools.wraps(save)
        def wrapped(checkpointer, *args, **kwargs):
            injector._wrap_engine(checkpointer)
            injector.saving = checkpointer
            try:
                return save(checkpointer, *args, **kwargs)
            finally:
                injector.saving = None

        return wrapped

    def _wrap_engine(self, checkpointer) -> None:
        """This engine's ``save_checkpoint`` and its checkpoint engine's ``save`` (every file
        DeepSpeed writes; the Checkpointer's own guard wraps this one at its first save)."""
        from megatron_branchnorm.training.checkpointer import ckpt

        engine, injector = checkpointer.engine, self
        if getattr(engine, "_mbn_fault_wrapped", False):
            return
        save_checkpoint = engine.save_checkpoint
        file_save = engine.checkpoint_engine.save

        def engine_save_checkpoint(*args, **kwargs):
            injector.in_engine_save = True
            try:
                out = save_checkpoint(*args, **kwargs)
            finally:
                injector.in_engine_save = False
            injector._exit_at("after_engine")
            return out

        def engine_file_save(*args, **kwargs):
            saving = injector.saving
            if saving is not None:
                tag_dir = saving.save_dir / ckpt.tag_for(saving.state.step)
                injector._full_disk("engine", saving.rank, tag_dir)
            out = file_save(*args, **kwargs)
            injector._exit_at("engine_file")
            return out

        engine.save_checkpoint = engine_save_checkpoint
        engine.checkpoint_engine.save = engine_file_save
        engine._mbn_fault_wrapped = True

    def _wrap_torch_save(self, torch_save: Callable) -> Callable:
        injector = self

        @functools.wraps(torch_save)
        def wrapped(*args, **kwargs):
            out = torch_save(*args, **kwargs)
            if injector.saving is not None and not injector.in_engine_save:
                injector._exit_at("after_rng")  # the Checkpointer's own file: the RNG state
            return out

        return wrapped

    def _wrap_write_manifest(self, write_manifest: Callable) -> Callable:
        injector = self

        @functools.wraps(write_manifest)
        def wrapped(tag_dir, *args, **kwargs):
            saving = injector.saving
            if saving is not None:
                injector._full_disk("manifest", saving.rank, tag_dir)
                injector._exit_at("after_config")
            write_manifest(tag_dir, *args, **kwargs)
            if saving is not None:
                injector._exit_at("after_manifest")

        return wrapped

    def _wrap_write_row(self, write_row: Callable) -> Callable:
        """The metrics writer's row write (only ``metrics.jsonl``'s rows go through it there)
        raises the full disk's OSError on the fault's rank, inside the writer's own guard."""
        injector = self

        @functools.wraps(write_row)
        def wrapped(fh, row):
            rank = int(os.environ.get("RANK", "0"))
            injector._full_disk("metrics", rank, fh.name, "fault injection")
            return write_row(fh, row)

        return wrapped


def _owner_name(owner) -> str:
    """``owner`` in an error message: a module's or a class's dotted name, else its type's."""
    if isinstance(owner, type):
        return f"{owner.__module__}.{owner.__qualname__}"
    if isinstance(owner, types.ModuleType):
        return owner.__name__
    return f"a {type(owner).__qualname__} instance"


def from_env() -> Injector:
    """The injector of :data:`FAULT_ENV` (an empty one when unset), installed; the fp16
    emulation applied when :data:`FP16_ON_CPU_ENV` is ``1``."""
    injector = Injector(parse_faults(os.environ.get(FAULT_ENV, ""))).install()
    if os.environ.get(FP16_ON_CPU_ENV) == "1":
        emulate_fp16_on_cpu()
    return injector


@contextlib.contextmanager
def injecting(spec: str) -> Iterator[Injector]:
    """Install ``spec``'s faults for the block (in-process), then take them off."""
    injector = Injector(parse_faults(spec)).install()
    try:
        yield injector
    finally:
        injector.uninstall()


def main(argv: list[str] | None = None) -> int:
    """Install the faults the environment asks for, then run train.py's main (its exit
    code); a spec that does not parse is one line and exit 2."""
    from megatron_branchnorm import train

    try:
        from_env()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT
    return train.main(argv)


if __name__ == "__main__":
    from megatron_branchnorm.train import exit_now

    exit_now(main())
