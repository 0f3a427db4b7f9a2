"""One registry of every front door (``FRONT_DOORS`` in megatron_branchnorm/commands/__init__.py)
and every other place that names them, checked against it: the modules that serve them, the thin
``tools/*.py`` scripts, setup.py's console scripts, ``runner.launch``'s ``WORKFLOWS`` and
``tool_command`` (a room below the registry's, docs/design.md §9), and design §9's rooms."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
import runpy
import sys
from pathlib import Path

import pytest
import setuptools

from megatron_branchnorm.commands import COMMANDS, FRONT_DOORS, KINDS, console_scripts
from megatron_branchnorm.runner.launch import WORKFLOWS, tool_command

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "megatron_branchnorm"
KIND_PACKAGE = {"command": "commands", "workflow": "workflows", "experiment": "experiments"}
"""Where each kind's modules live (the trainer's entry, a command, lives at the root)."""


def _source(module: str) -> Path:
    return ROOT / (module.replace(".", "/") + ".py")


def _defines_main(path: Path) -> bool:
    tree = ast.parse(path.read_text(), str(path))
    return any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)


def test_the_registry_names_each_door_once():
    for field in ("name", "module"):
        values = [getattr(d, field) for d in FRONT_DOORS]
        assert len(values) == len(set(values)), field
    for field in ("tool", "console"):
        values = [getattr(d, field) for d in FRONT_DOORS if getattr(d, field)]
        assert len(values) == len(set(values)), field
    for d in FRONT_DOORS:
        assert d.kind in KINDS, d
        if d.module != "megatron_branchnorm.train":
            assert d.module == f"megatron_branchnorm.{KIND_PACKAGE[d.kind]}.{d.name}", d
        if d.console:  # one naming rule: mbn-watch-bleu serves watch_bleu
            assert d.console == "mbn-" + d.name.replace("_", "-"), d
    assert COMMANDS == {d.name: d.module for d in FRONT_DOORS if d.kind != "experiment"}


@pytest.mark.parametrize("kind", KINDS)
def test_every_module_with_a_main_is_registered(kind):
    """A module of commands/, workflows/ or experiments/ with a ``main`` is a front door (its
    helper modules have none)."""
    package = PACKAGE / KIND_PACKAGE[kind]
    found = {p.stem for p in package.glob("*.py") if p.stem != "__init__" and _defines_main(p)}
    registered = {d.name for d in FRONT_DOORS if d.kind == kind and d.name != "train"}
    assert found == registered


@pytest.mark.parametrize("door", FRONT_DOORS, ids=lambda d: d.name)
def test_every_registered_module_has_main(door):
    main = getattr(importlib.import_module(door.module), "main", None)
    assert callable(main), door.module
    if door.kind != "experiment":  # a command line of its own: main(argv=None) -> int
        argv = inspect.signature(main).parameters.get("argv")
        assert argv is not None and argv.default is None, door.module


def _door_of(stem: str):
    doors = [d for d in FRONT_DOORS if d.tool == stem]
    assert len(doors) == 1, f"tools/{stem}.py is no registered front door"
    return doors[0]


def _calls_main(node: ast.stmt) -> bool:
    """``main()``, ``sys.exit(main())`` or ``raise SystemExit(main())``, and nothing else."""
    call = node.value if isinstance(node, ast.Expr) else None
    if isinstance(node, ast.Raise) and node.cause is None:
        call = node.exc
    if not isinstance(call, ast.Call) or call.keywords:
        return False
    inner = ast.unparse(call)
    return inner in ("main()", "sys.exit(main())", "SystemExit(main())")


@pytest.mark.parametrize("path", sorted((ROOT / "tools").glob("*.py")), ids=lambda p: p.name)
def test_every_tool_script_is_a_thin_door(path):
    """A docstring naming the code, ``from <the registered module> import main`` (and ``import
    sys``), and ``if __name__ == "__main__":`` calling it: no logic of its own."""
    door = _door_of(path.stem)
    tree = ast.parse(path.read_text(), str(path))
    docstring = ast.get_docstring(tree)
    assert docstring and f"{door.module.replace('.', '/')}.py" in docstring, path.name
    imports, guard = [], []
    for node in tree.body[1:]:
        if isinstance(node, ast.Import) and [a.name for a in node.names] == ["sys"]:
            continue
        if isinstance(node, ast.ImportFrom) and node.level == 0:
            imports.append((node.module, [(a.name, a.asname) for a in node.names]))
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            guard.append(node)
        else:
            pytest.fail(f"{path.name}:{node.lineno}: not a thin door ({ast.unparse(node)[:60]})")
    assert imports == [(door.module, [("main", None)])], path.name
    assert len(guard) == 1 and not guard[0].orelse and len(guard[0].body) == 1, path.name
    assert _calls_main(guard[0].body[0]), path.name


def test_every_registered_tool_exists():
    for d in FRONT_DOORS:
        if d.tool:
            assert (ROOT / "tools" / f"{d.tool}.py").is_file(), d


def test_setup_py_installs_the_registered_console_scripts(monkeypatch):
    """What setup.py hands setuptools (run with ``setup`` caught): exactly the registry's
    console scripts, each ``NAME=MODULE:FUNCTION`` naming a function that exists."""
    caught = {}
    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: caught.update(kwargs))
    runpy.run_path(str(ROOT / "setup.py"), run_name="setup")
    scripts = caught["entry_points"]["console_scripts"]
    assert scripts == console_scripts()
    by_console = {d.console: d for d in FRONT_DOORS if d.console}
    for script in scripts:
        name, _, target = script.partition("=")
        module, _, function = target.partition(":")
        door = by_console[name]
        assert (module, function) == (door.module, door.entry), script
        assert callable(getattr(importlib.import_module(module), function)), script


def test_runner_launch_agrees_with_the_registry():
    """``runner.launch`` may not import the registry (its room is below), so its names are
    checked here: the workflows, and the command line of every user command."""
    assert set(WORKFLOWS) == {d.name for d in FRONT_DOORS if d.kind == "workflow"}
    assert len(WORKFLOWS) == len(set(WORKFLOWS))
    for d in FRONT_DOORS:
        if d.kind != "experiment":
            assert tool_command(d.name) == [sys.executable, "-m", d.module], d.name


def _design_rooms() -> dict[str, str]:
    """design §9's table (docs/design.md's index sends §9 to its detail page,
    docs/explanation/architecture.md): each room's row by its name."""
    text = (ROOT / "docs" / "explanation" / "architecture.md").read_text()
    section = text.split("\n## 9. ", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 4:
            rows[cells[0]] = line
    return rows


@pytest.mark.parametrize("kind", ["command", "workflow"])
def test_design_section_9_names_every_command_and_workflow(kind):
    """The rooms ``commands`` and ``workflows`` of the whiteboard name each of their modules
    (the trainer's entry is the ``front`` room's ``train.py``)."""
    rooms = _design_rooms()
    row = rooms[KIND_PACKAGE[kind]]
    missing = [
        d.name
        for d in FRONT_DOORS
        if d.kind == kind
        and d.module.startswith(f"megatron_branchnorm.{KIND_PACKAGE[kind]}.")
        and not re.search(rf"(?<![\w.]){re.escape(d.name)}(?![\w.])", row)
    ]
    assert missing == []
    assert "`train.py`" in rooms["front"]
