"""Apex's fused LayerNorm from a source snapshot (tools/apex_snapshot.sh,
experiments/apex_layernorm.py), on the CPU.

The snapshot tool runs on a small fake Apex tree (a plain folder and a git repository): it
takes exactly the files the fused LayerNorm needs, following imports and includes, never Apex's
top-level ``__init__``, and writes a MANIFEST that the check tool reads back. The check tool on
a machine without CUDA says so in one row and builds nothing; its build step is run with a
stand-in child (a failing compiler, one that never ends). The registration that makes ``import
apex.normalization`` find a snapshot, and the model's ``layernorm_impl=apex`` take its class,
runs with a fake ``FusedLayerNorm``; the parity rows catch a wrong LayerNorm.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from megatron_branchnorm.experiments import apex_layernorm as apex_check
from megatron_branchnorm.model import residual

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOT = ROOT / "tools" / "apex_snapshot.sh"

FAKE_APEX = {
    "LICENSE": "a licence\n",
    "apex/__init__.py": "from . import optimizers\nfrom . import normalization\n",
    "apex/optimizers/__init__.py": "import amp_C\n",
    "apex/_autocast_utils.py": "import torch\n\ndef _cast(*args):\n    return args\n",
    "apex/normalization/__init__.py": "from .fused_layer_norm import FusedLayerNorm\n",
    "apex/normalization/fused_layer_norm.py": (
        "import importlib\nimport torch\nfrom apex._autocast_utils import _cast\n\n"
        "class FusedLayerNorm(torch.nn.LayerNorm):\n    pass\n"
    ),
    "csrc/layer_norm_cuda.cpp": "#include <torch/extension.h>\n#include <vector>\n",
    "csrc/layer_norm_cuda_kernel.cu": (
        '#include <cuda.h>\n#include "ATen/ATen.h"\n#include "static_switch.h"\n'
        '#include "type_shim.h"\n'
    ),
    "csrc/type_shim.h": '#include <ATen/ATen.h>\n  #  include "compat.h"\n',
    "csrc/static_switch.h": "#pragma once\n",
    "csrc/compat.h": "#pragma once\n",
    "csrc/mlp.cpp": '#include "mlp.h"\n',
    "csrc/mlp.h": "#pragma once\n",
}
"""A tree with Apex's layout: the fused LayerNorm's files and others it must leave."""
TAKEN = {
    "LICENSE",
    "apex/_autocast_utils.py",
    "apex/normalization/__init__.py",
    "apex/normalization/fused_layer_norm.py",
    "csrc/layer_norm_cuda.cpp",
    "csrc/layer_norm_cuda_kernel.cu",
    "csrc/type_shim.h",
    "csrc/static_switch.h",
    "csrc/compat.h",
}


def fake_apex(root: Path, files: dict[str, str] = FAKE_APEX) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        check=True, capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip


def checkout(root: Path, files: dict[str, str] = FAKE_APEX) -> tuple[Path, str]:
    """A git checkout holding ``files`` committed, and its commit."""
    work = fake_apex(root, files)
    git(work, "init", "-q")
    git(work, "add", "-A")
    git(work, "commit", "-q", "-m", "apex")
    return work, git(work, "rev-parse", "HEAD")


def bare_repo(tmp_path: Path, files: dict[str, str] = FAKE_APEX) -> tuple[Path, str]:
    """A bare git repository holding ``files`` at HEAD (no work tree), and its commit."""
    work, commit = checkout(tmp_path / "checkout", files)
    bare = tmp_path / "apex.git"
    subprocess.run(["git", "clone", "-q", "--bare", str(work), str(bare)], check=True)
    shutil.rmtree(work)
    return bare, commit


def source(kind: str, tmp_path: Path, files: dict[str, str] = FAKE_APEX) -> tuple[Path, str]:
    """A fake Apex of ``kind`` (:data:`KINDS`) and the commit its snapshot records."""
    if kind == "work tree":
        return fake_apex(tmp_path / "apex", files), "unknown"
    if kind == "git checkout":
        return checkout(tmp_path / "apex", files)
    return bare_repo(tmp_path, files)


KINDS = ["work tree", "git checkout", "bare git repository"]


def snapshot(src: Path, out: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(SNAPSHOT), str(src), str(out)], capture_output=True, text=True
    )


def tree_files(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize("kind", KINDS)
def test_the_snapshot_takes_exactly_the_fused_layernorms_files(kind, tmp_path):
    """Following the imports and the quoted includes: apex/_autocast_utils.py and the headers
    (compat.h through type_shim.h), never apex/__init__.py, the optimizers or other
    extensions; the MANIFEST lists each with its sha256 and the source commit, and the check
    tool reads it back."""
    src, commit = source(kind, tmp_path)
    out = tmp_path / "apex-src"
    done = snapshot(src, out)
    assert done.returncode == 0, done.stderr
    assert tree_files(out) == TAKEN | {"MANIFEST"}
    for name in TAKEN:
        assert (out / name).read_text() == FAKE_APEX[name], name
    read = apex_check.read_snapshot(out)
    assert read.commit == commit
    assert read.files == {
        name: hashlib.sha256(FAKE_APEX[name].encode()).hexdigest() for name in TAKEN
    }
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize(
    ("kind", "change", "needle"),
    [
        ("work tree", {"csrc/type_shim.h": None}, "lacks csrc/type_shim.h (included by csrc/lay"),
        ("bare git repository", {"csrc/type_shim.h": None}, "lacks csrc/type_shim.h (included"),
        (
            "work tree",
            {"csrc/compat.h": None},
            "lacks csrc/compat.h (included by csrc/type_shim.h)",
        ),
        ("bare git repository", {"LICENSE": None}, "lacks LICENSE"),
        ("work tree", {"csrc/layer_norm_cuda.cpp": None}, "lacks csrc/layer_norm_cuda.cpp"),
        (
            "work tree",
            {"apex/normalization/fused_layer_norm.py": "from apex.contrib.gone import x\n"},
            "fused_layer_norm.py imports apex.contrib.gone, and SRC has no apex.contrib",
        ),
    ],
)
def test_the_snapshot_refuses_a_src_lacking_a_needed_file(kind, change, needle, tmp_path):
    files = {k: v for k, v in {**FAKE_APEX, **change}.items() if v is not None}
    src = source(kind, tmp_path, files)[0]
    done = snapshot(src, tmp_path / "apex-src")
    err = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(err) == 1 and err[0].startswith("error: SRC "), done.stderr
    assert needle in err[0], err[0]
    assert not (tmp_path / "apex-src").exists()
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]


def test_the_snapshot_replaces_its_own_and_never_another_folder(tmp_path):
    src, out = fake_apex(tmp_path / "apex"), tmp_path / "apex-src"
    assert snapshot(src, out).returncode == 0
    (src / "LICENSE").write_text("a newer licence\n")
    assert snapshot(src, out).returncode == 0  # an earlier snapshot of the tool: replaced
    assert (out / "LICENSE").read_text() == "a newer licence\n"
    (out / "csrc" / "notes.txt").write_text("mine\n")
    done = snapshot(src, out)
    assert done.returncode == 2 and "holds csrc/notes.txt" in done.stderr, done.stderr
    assert (out / "csrc" / "notes.txt").read_text() == "mine\n"
    users = tmp_path / "users"
    users.mkdir()
    (users / "thesis.tex").write_text("years of work")
    done = snapshot(src, users)
    assert done.returncode == 2 and "is not a snapshot of this tool" in done.stderr, done.stderr
    assert tree_files(users) == {"thesis.tex"}


@pytest.fixture
def snap(tmp_path) -> Path:
    out = tmp_path / "apex-src"
    assert snapshot(fake_apex(tmp_path / "apex"), out).returncode == 0
    return out


def test_without_cuda_one_row_says_not_run_and_nothing_is_built(
    snap, tmp_path, capsys, monkeypatch
):
    """Exit 0 and a ``not run: no CUDA device`` row (no verdict): a device script tells this
    skip from a failed check (exit 1) or bad input (exit 2); no build starts, no build folder
    is made, and the --json report is one this tool recognises as its own."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)

    def never(*args, **kwargs):
        raise AssertionError("a build started without a CUDA device")

    monkeypatch.setattr(apex_check, "build_extension", never)
    build, report = tmp_path / "build", tmp_path / "apex.json"
    argv = ["--src", str(snap), "--build-dir", str(build), "--json", str(report)]
    assert apex_check.main(argv) == 0
    out = capsys.readouterr().out
    assert "| Apex fused LayerNorm | not run: no CUDA device |  |  |" in out
    assert not build.exists()
    rows = json.loads(report.read_text())["rows"]
    assert rows[-1] == {"check": "Apex fused LayerNorm", "value": "not run: no CUDA device",
                        "limit": "", "ok": None}  # fmt: skip
    assert apex_check.is_our_report(report)
    assert apex_check.main(argv) == 0  # its own report and empty build folder: a rerun runs


def test_a_report_of_another_tool_or_a_users_json_is_not_ours(tmp_path):
    others = {
        "gpu_check.json": '[{"check": "torch", "value": "2.4", "limit": "", "ok": null}]',
        "user.json": '{"tool": "apex_check"}',
        "notes.md": "| a | b |\n",
    }
    for name, text in others.items():
        (tmp_path / name).write_text(text)
        assert not apex_check.is_our_report(tmp_path / name), name


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda s: (s / "csrc" / "type_shim.h").write_text("edited\n"), "csrc/type_shim.h differs"),
        (lambda s: (s / "LICENSE").unlink(), "LICENSE is missing"),
        (lambda s: (s / "MANIFEST").unlink(), "no readable MANIFEST"),
        (lambda s: (s / "MANIFEST").write_text("# a list\n"), "is not a MANIFEST of"),
        (
            lambda s: (s / "MANIFEST").write_text(
                (s / "MANIFEST").read_text() + "0" * 64 + "  ../outside.txt\n"
            ),
            "line 14: ../outside.txt lies outside",
        ),
    ],
)
def test_a_snapshot_that_differs_from_its_manifest_is_refused(snap, edit, needle, capsys):
    edit(snap)
    assert apex_check.main(["--src", str(snap)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: --src {snap}: ") and needle in err[0], err


def test_a_build_dir_with_a_lock_or_a_users_file_is_refused_before_anything(snap, tmp_path, capsys):
    build = tmp_path / "build"
    build.mkdir()
    (build / "lock").write_text("")
    assert apex_check.main(["--src", str(snap), "--build-dir", str(build)]) == 2
    assert "holds lock" in capsys.readouterr().err
    (build / "lock").unlink()
    (build / "mine.txt").write_text("mine\n")
    assert apex_check.main(["--src", str(snap), "--build-dir", str(build)]) == 2
    assert "holds mine.txt, which apex_check does not write" in capsys.readouterr().err
    assert apex_check.main(["--src", str(snap), "--build-dir", str(snap / "build")]) == 2
    assert "lies inside --src" in capsys.readouterr().err


def test_a_failed_build_is_reported_with_its_error_line(snap, tmp_path, monkeypatch):
    lines = [
        "[1/3] nvcc -Werror=return-type ...",
        "kernel.cu(3): error: no such type",
        "kernel.cu(9): error: and so on",
        "RuntimeError: Error building extension 'fused_layer_norm_cuda'",
    ]
    child = f"import sys; print({chr(10).join(lines)!r}); sys.exit(1)"
    monkeypatch.setattr(apex_check, "_BUILD", child)
    built = apex_check.build_extension(
        apex_check.read_snapshot(snap), tmp_path / "b", "9.0", 2, 600
    )
    assert built.error is not None and built.error.startswith("exit 1: kernel.cu(3): error: no")


def test_a_build_past_its_time_is_stopped_and_its_lock_removed(snap, tmp_path, monkeypatch):
    """The child takes torch's build lock and never ends: it is stopped at --max-seconds."""
    child = (
        "import json, pathlib, sys, threading; "
        "pathlib.Path(json.loads(sys.argv[1])['build_directory'], 'lock').touch(); "
        "threading.Event().wait()"
    )
    monkeypatch.setattr(apex_check, "_BUILD", child)
    built = apex_check.build_extension(apex_check.read_snapshot(snap), tmp_path / "b", "9.0", 2, 1)
    assert built.error is not None and built.error.startswith("not finished in 1 s (stopped")
    assert not (tmp_path / "b" / "lock").exists()


def test_sigterm_during_the_build_stops_the_build_too(snap, tmp_path):
    """A device script's time limit (SIGTERM) ends the tool and its build child with it,
    never leaving a compiler running: the child is gone and its lock removed, exit 143. The
    tool runs in a process of its own, which alone gets the signal."""
    child = (
        "import json, os, pathlib, sys, threading; "
        "pathlib.Path(json.loads(sys.argv[1])['build_directory'], 'lock').write_text("
        "str(os.getpid())); threading.Event().wait()"
    )
    tool = (
        "import sys\n"
        "from pathlib import Path\n"
        "from megatron_branchnorm.experiments import apex_layernorm as apex_check\n"
        f"apex_check._BUILD = {child!r}\n"
        "snapshot = apex_check.read_snapshot(Path(sys.argv[1]))\n"
        "apex_check.build_extension(snapshot, Path(sys.argv[2]), '9.0', 2, 600)\n"
    )
    lock = tmp_path / "b" / "lock"
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", tool, str(snap), str(tmp_path / "b")], env=env,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        while not (lock.exists() and lock.read_text()):  # the child's own event: its lock
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            threading.Event().wait(0.01)
        child_pid = int(lock.read_text())
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM, proc.stderr.read()[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not lock.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(child_pid, 0)


def test_the_build_runs_load_with_apexs_flags_for_one_arch(snap, tmp_path):
    kwargs = apex_check.build_kwargs(apex_check.read_snapshot(snap), tmp_path / "b")
    assert kwargs["name"] == "fused_layer_norm_cuda"
    assert [Path(s).name for s in kwargs["sources"]] == ["layer_norm_cuda.cpp",
                                                         "layer_norm_cuda_kernel.cu"]  # fmt: skip
    assert "-O3" in kwargs["extra_cflags"] and "-O3" in kwargs["extra_cuda_cflags"]
    assert apex_check.arch_list((9, 0)) == "9.0" and apex_check.arch_list((12, 1)) == "12.1"


@pytest.fixture
def registered(snap, tmp_path, monkeypatch):
    """The fake snapshot registered as this process's apex, with another package named apex
    on sys.path (as PyPI's unrelated ``apex`` would be); removed afterwards."""
    for name in [m for m in sys.modules if m == "apex" or m.startswith("apex.")]:
        monkeypatch.delitem(sys.modules, name)
    other = tmp_path / "site" / "apex"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("raise ImportError('another package named apex')\n")
    monkeypatch.syspath_prepend(str(other.parent))
    before = set(sys.modules)
    cls = apex_check.register_apex(apex_check.read_snapshot(snap))
    yield cls
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_registration_makes_the_models_apex_layernorm_take_the_snapshots_class(registered, snap):
    """``import apex.normalization`` finds the snapshot (not Apex's top-level __init__, which
    would import the optimizers, nor another package named apex on sys.path), the model's
    auto|apex detection sees it, and a model built with layernorm_impl=apex runs every
    LayerNorm through it."""
    assert Path(sys.modules[registered.__module__].__file__).is_relative_to(snap.resolve())
    assert "apex.optimizers" not in sys.modules
    assert residual.apex_layernorm_class() is registered
    assert residual.select_layernorm("auto", "cuda") == "apex"
    rows = apex_check.model_rows(registered, "cpu")
    assert [r.ok for r in rows] == [True] * 4, rows
    fused, total = rows[0].value.split(" (")[0].split(" of ")
    assert fused == total and int(total) > 0, rows[0]


class _OffByABias(torch.nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) + 0.05


def test_the_parity_rows_pass_a_layernorm_and_fail_a_wrong_one(monkeypatch):
    monkeypatch.setattr(apex_check, "SHAPES", ((64, 32),))
    rows = apex_check.parity_rows(torch.nn.LayerNorm, "cpu")
    assert len(rows) == 8 and all(r.ok for r in rows), rows
    rows = apex_check.parity_rows(_OffByABias, "cpu")
    outputs = [r for r in rows if "output" in r.check]
    assert [r.ok for r in outputs] == [False, False], outputs
