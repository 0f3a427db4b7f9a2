"""The house (docs/design.md §9): the package's import graph read from its source, every import
counted (a function's lazy import too). Modules live in rooms (the groups below); an arrow may
only run to a room its room may import, and no arrows form a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_branchnorm"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

ROOMS = (
    "formats",  # the on-disk formats, one owner each, and the one user-error base (errors)
    "base",  # config, tokens, paper, resources: the package root below the front doors
    "model",
    "data",
    "plan",  # parallel.partition and parallel.planner: the layout on paper
    "pipeline",  # parallel.pipeline: the layout run by DeepSpeed
    "runner",  # starting ranks and tools, logged steps, the machine, plots of a run
    "training",
    "inference",
    "front",  # cli and train: what every entry point shares, and the launchers' entry
    "experiments",
    "workflows",
    "commands",
)
"""Bottom to top. A room may import its own modules and the rooms listed for it below; the
whiteboard's rules (docs/design.md §9) are each one line here."""
MAY_IMPORT = {
    "formats": set(),
    "base": {"formats"},
    "model": {"formats", "base"},  # never the data, the pipeline or training
    "data": {"formats", "base"},  # never the model
    "plan": {"formats", "base"},  # pure: no model, no torch, no DeepSpeed (below)
    "pipeline": {"formats", "base", "model", "plan"},
    "runner": {"formats", "base"},
    "training": {"formats", "base", "model", "data", "plan", "pipeline", "runner"},
    "inference": {"formats", "base", "model", "data", "plan"},  # never training or DeepSpeed
}
_BELOW_FRONT = set(ROOMS[: ROOMS.index("front")])
MAY_IMPORT["front"] = _BELOW_FRONT
MAY_IMPORT["experiments"] = _BELOW_FRONT | {"front"}
MAY_IMPORT["workflows"] = MAY_IMPORT["experiments"] | {"experiments"}
MAY_IMPORT["commands"] = MAY_IMPORT["workflows"] | {"workflows"}
ROOT_ROOMS = {
    "errors": "formats",
    "config": "base",
    "paper": "base",
    "resources": "base",
    "tokens": "base",
    "cli": "front",
    "train": "front",
}
"""Every module at the package root and its room; at most 10 modules live there."""
PACKAGE_ROOMS = {
    "formats": "formats",
    "model": "model",
    "data": "data",
    "parallel": "plan",
    "runner": "runner",
    "training": "training",
    "inference": "inference",
    "experiments": "experiments",
    "workflows": "workflows",
    "commands": "commands",
}
"""Every subpackage and its room (``parallel.pipeline`` has a room of its own)."""
NO_DEEPSPEED = ("formats", "base", "model", "data", "plan", "runner", "inference")
"""Rooms that never import DeepSpeed (nor the pipeline adapter, which does)."""
NO_TORCH = ("plan", "runner")
"""Rooms that never import torch: the plan is arithmetic on a config."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports, and ``deepspeed`` or ``torch`` when it imports
    them."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            # ``from pkg import module`` is that module; ``from module import name`` the module
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names
            ]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in ("deepspeed", "torch"):
                found.add(target.split(".")[0])
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                found.add(target)
    return found


def room(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts:
        return "base"
    if len(parts) == 1 and parts[0] not in PACKAGE_ROOMS:
        return ROOT_ROOMS[parts[0]]
    if parts[:2] == ["parallel", "pipeline"]:
        return "pipeline"
    return PACKAGE_ROOMS[parts[0]]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_arrow_runs_up(graph):
    wrong = sorted(
        f"{a} ({room(a)}) imports {b} ({room(b)})"
        for a, targets in graph.items()
        for b in targets
        if b not in ("deepspeed", "torch") and room(b) not in MAY_IMPORT[room(a)] | {room(a)}
    )
    assert wrong == []


def test_every_module_has_a_room(graph):
    """A new root module or subpackage must be given its room here (and in docs/design.md §9)
    before it is used; the root stays at most 10 modules."""
    root = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert root == set(ROOT_ROOMS)
    assert packages == set(PACKAGE_ROOMS)
    assert len(root) + 1 <= 10  # with __init__
    assert {room(m) for m in graph} <= set(ROOMS)


def test_the_plan_is_pure(graph):
    """The plan and the runner import neither torch nor DeepSpeed, even lazily."""
    wrong = sorted(
        f"{a} imports {b}"
        for a, targets in graph.items()
        for b in targets
        if room(a) in NO_TORCH and b in ("torch", "deepspeed")
    )
    assert wrong == []


def test_no_circles(graph):
    """No strongly connected component of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    assert circles == []


def test_only_training_and_above_import_deepspeed(graph):
    """Not even lazily: a checkpoint's pickled DeepSpeed objects are read with stand-ins."""
    wrong = sorted(
        a
        for a, targets in graph.items()
        if room(a) in NO_DEEPSPEED
        and ("deepspeed" in targets or f"{PACKAGE}.parallel.pipeline" in targets)
    )
    assert wrong == []


def test_one_module_per_name():
    """A workflow's command lives in its module; no root module shares a command's name."""
    commands = {p.stem for p in (ROOT / "commands").glob("*.py")} - {"__init__"}
    workflows = {p.stem for p in (ROOT / "workflows").glob("*.py")} - {"__init__"}
    root = {p.stem for p in ROOT.glob("*.py")} - {"__init__"}
    assert commands & workflows == set()
    assert commands & root == set()
    assert workflows & root == set()
