"""The house (docs/design.md §9): the package's import graph read from its source, every import
counted (a function's lazy import too). Rooms are modules, floors are the groups below; an
arrow may only run down or sideways, and no arrows form a circle."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "megatron_branchnorm"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE

FLOORS = (
    "formats",  # the on-disk formats, one owner each, and the one user-error base
    "library",  # config, partition, model/, data/, pipeline, ...: the package root
    "training",
    "inference",
    "experiments",
    "workflows",
    "commands",
)
"""Bottom to top. The package root's modules are ``library`` but ``errors`` (``formats``) and
``train`` (the launchers' entry, ``training``)."""
MAY_NOT_IMPORT = {
    "formats": {"library", "training", "inference", "experiments", "workflows", "commands"},
    "library": {"training", "inference", "experiments", "workflows", "commands"},
    "training": {"inference", "experiments", "workflows", "commands"},
    "inference": {"training", "experiments", "workflows", "commands"},
    "experiments": {"workflows", "commands"},
    "workflows": {"commands"},
    "commands": set(),
}
NO_DEEPSPEED = ("formats", "inference")
"""Floors that never import DeepSpeed (nor the pipeline adapter, which does)."""


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The package's modules ``name`` imports, and ``deepspeed`` when it imports that."""
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
            if target.split(".")[0] == "deepspeed":
                found.add("deepspeed")
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and target != PACKAGE:
                found.add(target)
    return found


def floor(module: str) -> str:
    parts = module.split(".")
    if module == f"{PACKAGE}.errors":
        return "formats"
    if module == f"{PACKAGE}.train":
        return "training"
    if len(parts) > 2 and parts[1] in FLOORS:
        return parts[1]
    return "library"


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_no_arrow_runs_up(graph):
    wrong = sorted(
        f"{a} ({floor(a)}) imports {b} ({floor(b)})"
        for a, targets in graph.items()
        for b in targets
        if b != "deepspeed" and floor(b) in MAY_NOT_IMPORT[floor(a)]
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


def test_inference_and_formats_do_not_import_deepspeed(graph):
    """Not even lazily: a checkpoint's pickled DeepSpeed objects are read with stand-ins."""
    wrong = sorted(
        a
        for a, targets in graph.items()
        if floor(a) in NO_DEEPSPEED and ("deepspeed" in targets or f"{PACKAGE}.pipeline" in targets)
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


def test_floors_known(graph):
    """Every package under the root is a floor, or part of the library (model/, data/)."""
    packages = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    assert packages - set(FLOORS) <= {"model", "data"}
