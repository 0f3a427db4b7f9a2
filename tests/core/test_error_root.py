"""One user-error base (docs/design.md §9, megatron_branchnorm/errors.py): every exception class
the package defines derives from :class:`UserError`, so no error a user's input or environment
causes has a second root that a front door would print as a traceback."""

from __future__ import annotations

import ast
import builtins
import importlib

import pytest

from megatron_branchnorm.errors import UserError
from tests.core.test_architecture import PACKAGE, ROOT

_BUILTIN_EXCEPTIONS = {
    name
    for name, obj in vars(builtins).items()
    if isinstance(obj, type) and issubclass(obj, BaseException)
}


def _exception_classes() -> list[tuple[str, type]]:
    """Every exception class the package defines, imported from its module. A module is
    imported only when one of its classes names a base that could be an exception (a
    built-in exception or a name ending in Error/Exception/Interrupt): the front doors
    (train.py installs signal handlers at import) define none."""
    wanted: dict[str, list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = ".".join((PACKAGE, *path.relative_to(ROOT).with_suffix("").parts))
        module = module.removesuffix(".__init__")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if not isinstance(node, ast.ClassDef):
                continue
            bases = [ast.unparse(b).rpartition(".")[2] for b in node.bases]
            if any(b in _BUILTIN_EXCEPTIONS or b.endswith(("Error", "Exception")) for b in bases):
                wanted.setdefault(module, []).append(node.name)
    classes = []
    for module, names in wanted.items():
        loaded = importlib.import_module(module)
        classes += [(module, getattr(loaded, name)) for name in names]
    return [(m, c) for m, c in classes if isinstance(c, type) and issubclass(c, BaseException)]


CONTROL_FLOW = {"megatron_branchnorm.commands.reference._Parsed"}
"""Classes raised and caught inside one function to stop a call early (the reference generator
catches a front door's parser as it starts parsing: the signal must fly past ``run_main``'s
handlers, so it is a BaseException). None of them reaches a user."""

EXCEPTIONS = [(m, c) for m, c in _exception_classes() if f"{m}.{c.__name__}" not in CONTROL_FLOW]


def test_control_flow_classes_are_base_exceptions_caught_where_raised():
    for name in CONTROL_FLOW:
        module, _, cls_name = name.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        assert cls.__bases__ == (BaseException,), name  # no handler of Exception catches it


def test_the_package_defines_exception_classes():
    names = {cls.__name__ for _, cls in EXCEPTIONS}
    assert {"UserError", "ConfigError", "PeerLostError", "CheckpointError"} <= names


@pytest.mark.parametrize(("module", "cls"), EXCEPTIONS, ids=lambda x: getattr(x, "__name__", x))
def test_every_exception_class_derives_from_the_one_base(module, cls):
    assert issubclass(cls, UserError), (
        f"{module}.{cls.__name__} derives from {[b.__name__ for b in cls.__mro__[1:]]}, "
        "not from megatron_branchnorm.errors.UserError"
    )


def test_a_lost_peer_keeps_its_exit_code_and_line():
    """PeerLostError under the one base still reads as a lost peer (exit 4 in
    training.trainer.run, which catches it before any front door's exit 2)."""
    from megatron_branchnorm.training.environment import PeerLostError, peer_lost

    exc = PeerLostError("another rank is gone")
    assert peer_lost(exc) and isinstance(exc, RuntimeError) and str(exc) == "another rank is gone"
