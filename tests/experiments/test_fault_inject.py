"""The fault injector's patches (megatron_branchnorm/experiments/fault_inject.py) land on code
that exists: patching a missing attribute is an error naming it, never a new attribute the
trainer does not call (a renamed ``Trainer._update`` would otherwise turn every fault test
into a run without a fault), and uninstalling puts every original back."""

from __future__ import annotations

import signal
import time
import types

import pytest
import torch

from megatron_branchnorm.experiments.fault_inject import Injector, injecting, parse_faults
from megatron_branchnorm.training import checkpointer, grad_norm, metrics, stop_signals, trainer

EVERY_PATCH = (
    (trainer.Trainer, "_update"),
    (grad_norm, "pipeline_grad_norm"),
    (checkpointer.Checkpointer, "save"),
    (torch, "save"),
    (checkpointer.ckpt, "write_manifest"),
    (metrics, "write_row"),
)
"""What a spec with every kind of fault patches (Injector's docstring)."""


def _current(owner, name):
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name)


def test_patching_a_missing_attribute_raises_and_creates_nothing():
    module = types.ModuleType("some_module")
    injector = Injector({})
    with pytest.raises(AttributeError, match=r"some_module has no attribute 'open' to patch"):
        injector._patch(module, "open", lambda original: original)
    assert not hasattr(module, "open")

    class Owner:
        pass

    with pytest.raises(AttributeError, match=r"\.Owner has no attribute '_update' to patch"):
        injector._patch(Owner, "_update", lambda original: original)
    assert not hasattr(Owner, "_update")
    injector.uninstall()  # nothing to undo


def test_a_renamed_target_fails_the_install_and_leaves_nothing_patched(monkeypatch):
    """The metrics writer without ``write_row`` (as after a rename): enospc@metrics refuses to
    install, and the patches made before it are taken off again."""
    update = trainer.Trainer.__dict__["_update"]
    monkeypatch.delattr(metrics, "write_row")
    with pytest.raises(AttributeError, match=r"training\.metrics has no attribute 'write_row'"):
        with injecting("enospc@metrics"):
            pass
    assert trainer.Trainer.__dict__["_update"] is update
    assert not hasattr(metrics, "write_row")


def test_every_fault_patches_code_that_exists_and_uninstall_restores_it():
    originals = [_current(owner, name) for owner, name in EVERY_PATCH]
    spec = "nan_loss@3,inf_grad@5:stage0,save_exit@after_rng,enospc@metrics,slow@0"
    with injecting(spec) as injector:
        assert set(injector.faults) == set(parse_faults(spec))
        patched = [_current(owner, name) for owner, name in EVERY_PATCH]
        same = [n for (_, n), a, b in zip(EVERY_PATCH, originals, patched, strict=True) if a is b]
        assert same == []
    assert [_current(owner, name) for owner, name in EVERY_PATCH] == originals
    assert not hasattr(metrics, "open")  # the builtin, not a module global made by a patch


def test_an_inherited_method_is_patched_on_the_class_and_deleted_again():
    class Base:
        def save(self):
            return "base"

    class Child(Base):
        pass

    injector = Injector({})
    injector._patch(Child, "save", lambda original: lambda self: "patched " + original(self))
    assert Child().save() == "patched base" and Base().save() == "base"
    injector.uninstall()
    assert "save" not in Child.__dict__ and Child().save() == "base"


@pytest.mark.parametrize("released_by", ["path", "signal"])
def test_a_held_update_goes_on_when_released_or_signalled(tmp_path, monkeypatch, released_by):
    """``hold@PATH`` waits before updates after the first until PATH exists, or until a stop
    signal is recorded (the update then runs and the trainer stops after it, as unheld)."""
    go = tmp_path / "go"
    calls = []
    update = Injector(parse_faults(f"hold@{go}"))._wrap_update(lambda _, t: calls.append(t))
    update(None, 1)  # the first update is never held
    assert calls == [1]
    polls = []

    def sleep(_seconds):  # each poll releases the hold on its first turn: no wall clock
        polls.append(1)
        assert len(polls) == 1, "still held after its release"
        if released_by == "path":
            go.touch()
        else:
            monkeypatch.setattr(stop_signals, "_received", signal.SIGTERM)

    monkeypatch.setattr(time, "sleep", sleep)
    update(None, 2)
    assert calls == [1, 2] and len(polls) == 1
