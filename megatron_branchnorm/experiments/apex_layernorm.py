"""NVIDIA Apex's fused LayerNorm, built from a source snapshot, against torch's LayerNorm on a
CUDA device (``tools/apex_check.py``; docs: GPU check, Apex).

    bash tools/apex_snapshot.sh APEX_CHECKOUT     # apex-src/: Apex's fused LayerNorm sources
    python tools/apex_check.py --src apex-src --build-dir apex-build --json apex.json

The snapshot (``tools/apex_snapshot.sh``: Apex's LICENSE, ``apex/normalization``, the module it
imports, and the sources of the ``fused_layer_norm_cuda`` extension, with a MANIFEST of their
sha256) is checked against its MANIFEST first. Then, on a CUDA device:

1. **build**: only the ``fused_layer_norm_cuda`` extension, just in time
   (``torch.utils.cpp_extension.load``, Apex's own flags: ``-O3``, and for nvcc ``-O3
   -maxrregcount=50 --use_fast_math``), for the present GPU's architecture only
   (``TORCH_CUDA_ARCH_LIST`` from its compute capability) with ``MAX_JOBS`` = the CPU count, in
   a child process stopped after ``--max-seconds`` (a slow nvcc never eats a lent device's
   minutes); its log is ``BUILD_DIR/build.log``. The built module is registered as
   ``fused_layer_norm_cuda`` and the snapshot as the package ``apex`` of this process
   (without Apex's top-level ``apex/__init__.py``, which imports its optimizers and more), so
   ``import apex.normalization``, which the model's ``layernorm_impl`` auto|apex looks for
   (``model.residual.apex_layernorm_class``), finds the snapshot's ``FusedLayerNorm``.
2. **parity**: ``FusedLayerNorm`` against ``torch.nn.LayerNorm`` with the same weight and bias
   (not ones and zeros), at (16384, 512) and (4096, 1024), in fp32 and bf16: the output and
   the gradients of the input, weight and bias, each as max |apex - torch| / max |torch|.
   Limits: in bf16 1e-2 for all four: both compute in fp32 and round once to bf16, so they
   differ at most by one bf16 ulp of an element (2^-7 = 7.8e-3 of it) where the fp32 values
   fall either side of a rounding boundary. In fp32 the output 1e-5 (a few ulp, 2^-24 = 6e-8,
   through one reduction of d <= 1024 terms and a fast-math rsqrt) and the gradients 1e-4 (the
   weight and bias gradients sum 16,384 rows in another order: about sqrt(N) 2^-24 = 8e-6).
3. **speed**: forward + backward (``torch.autograd.grad`` of the input, weight and bias) per
   call, by CUDA events around each call, the two implementations alternating call by call:
   the median of :data:`REPEATS` after :data:`WARMUP` calls, at the same shapes and dtypes.
4. **model**: a tiny model (tiny_cpu, 3L-3L, no dropout) built with
   ``model.layernorm_impl=apex`` runs every LayerNorm through the snapshot's
   ``FusedLayerNorm`` (each LayerNorm's backend and its fused module's class); ``auto`` on
   CUDA picks it too; its logits and gradient against the same model with
   ``layernorm_impl=torch`` (same weights, fp32) within 1e-4.

Without a CUDA device nothing is built: one row ``not run: no CUDA device`` and exit 0, so that
a run on a CPU machine (tools/device_run.sh with ``DEVICE=cpu``) tells a skipped check (exit 0
and that row) from a failed one (exit 1: the build or a check failed; the table says which)
and from bad input (exit 2, one line: a snapshot that does not match its MANIFEST, an output
that would land on someone else's files).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.experiments.check_table import ROW_KEYS, TABLE_HEADER, Row, format_rows
from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.formats.outputs import (
    check_output_file,
    check_scratch_dir,
    read_report,
    write_text_output,
)

TOOL = "apex_check"
EXTENSION = "fused_layer_norm_cuda"
"""The extension's module name: what ``apex/normalization/fused_layer_norm.py`` imports."""
SOURCES = ("csrc/layer_norm_cuda.cpp", "csrc/layer_norm_cuda_kernel.cu")
CXX_FLAGS = ["-O3"]
NVCC_FLAGS = ["-O3", "-maxrregcount=50", "--use_fast_math"]
"""Apex's setup.py flags for this extension."""
MANIFEST = "MANIFEST"
MANIFEST_HEADER = "# apex-snapshot: NVIDIA/apex's fused LayerNorm (tools/apex_snapshot.sh)"
"""The first line of a snapshot's MANIFEST (tools/apex_snapshot.sh writes it)."""
BUILD_ENTRIES = ("build.ninja", ".ninja_deps", ".ninja_log", "*.o", f"{EXTENSION}.so", "build.log")
"""What the build writes in ``--build-dir`` (torch's JIT build and this tool's log): a rerun
reuses such a directory, and refuses one holding anything else."""
BUILD_LOCK = "lock"
"""torch's lock file of a build in progress in ``--build-dir``."""
SHAPES = ((16384, 512), (4096, 1024))
TOL = {"fp32": {"output": 1e-5, "grad": 1e-4}, "bf16": {"output": 1e-2, "grad": 1e-2}}
MODEL_TOL = 1e-4
MODEL_OVERRIDES = ["model.encoder_layers=3", "model.decoder_layers=3", "model.dropout=0.0"]
REPEATS = 100
WARMUP = 10
_BUILD = (
    "import json, sys; from torch.utils.cpp_extension import load; load(**json.loads(sys.argv[1]))"
)
"""The child process that builds: ``load`` with the keyword arguments in its argv (one line:
its build log's first line, ``$ COMMAND``, is one line)."""


class SnapshotError(UserError, ValueError):
    """A ``--src`` that is not a complete, unchanged snapshot of tools/apex_snapshot.sh."""


@dataclass(frozen=True)
class Snapshot:
    root: Path
    commit: str
    files: dict[str, str]  # path -> sha256


def read_snapshot(src: str | Path) -> Snapshot:
    """The snapshot at ``src``: its MANIFEST read and every file it lists checked against its
    sha256, and the extension's sources and ``apex/normalization`` among them; a
    :class:`SnapshotError` naming the file otherwise."""
    root = Path(src)
    manifest = root / MANIFEST
    try:
        lines = manifest.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise SnapshotError(
            f"--src {src}: no readable {MANIFEST} ({one_line(exc, 200)}); tools/apex_snapshot.sh "
            "makes a snapshot"
        ) from None
    if not lines or lines[0] != MANIFEST_HEADER:
        raise SnapshotError(f"--src {src}: {manifest} is not a MANIFEST of tools/apex_snapshot.sh")
    commit, files = "unknown", {}
    for number, line in enumerate(lines[1:], start=2):
        if line.startswith("# commit: "):
            commit = line.removeprefix("# commit: ")
        elif not line.startswith("#"):
            found = re.fullmatch(r"([0-9a-f]{64})  (\S.*)", line)
            if found is None:
                raise SnapshotError(f"--src {src}: {manifest} line {number}: not `SHA256  PATH`")
            name = found[2]
            if name.startswith("/") or ".." in Path(name).parts:
                raise SnapshotError(f"--src {src}: {manifest} line {number}: {name} lies outside")
            files[name] = found[1]
    needed = [*SOURCES, "apex/normalization/__init__.py", "apex/normalization/fused_layer_norm.py"]
    missing = [f for f in needed if f not in files]
    if missing:
        raise SnapshotError(f"--src {src}: its {MANIFEST} lists no {', '.join(missing)}")
    for name, digest in files.items():
        path = root / name
        if not path.is_file():
            raise SnapshotError(f"--src {src}: {name} is missing (listed in its {MANIFEST})")
        if hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            raise SnapshotError(
                f"--src {src}: {name} differs from its {MANIFEST}'s sha256 (changed since the "
                "snapshot: rerun tools/apex_snapshot.sh)"
            )
    return Snapshot(root.resolve(), commit, files)


# --------------------------------------------------------------------------------------------
# Build and registration
# --------------------------------------------------------------------------------------------


def arch_list(capability: tuple[int, int]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for one device of compute ``capability`` (9, 0) -> ``9.0``."""
    return f"{capability[0]}.{capability[1]}"


def build_kwargs(snapshot: Snapshot, build_dir: Path) -> dict[str, Any]:
    """The keyword arguments of ``torch.utils.cpp_extension.load`` that build the extension."""
    return {
        "name": EXTENSION,
        "sources": [str(snapshot.root / s) for s in SOURCES],
        "extra_cflags": CXX_FLAGS,
        "extra_cuda_cflags": NVCC_FLAGS,
        "build_directory": str(build_dir.resolve()),
        "verbose": True,
    }


@dataclass(frozen=True)
class Build:
    seconds: float
    error: str | None  # None: built
    library: Path


def build_extension(
    snapshot: Snapshot, build_dir: Path, arch: str, jobs: int, max_seconds: float
) -> Build:
    """Build the extension in a child process (its own process group, its output in
    ``build_dir/build.log``), stopped with its compilers after ``max_seconds``, or when this
    process gets SIGTERM (a device script's time limit: exit 143 once they are stopped)."""
    from megatron_branchnorm.runner.launch import logged_group

    build_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": arch, "MAX_JOBS": str(jobs)}
    cmd = [sys.executable, "-c", _BUILD, json.dumps(build_kwargs(snapshot, build_dir))]
    log = build_dir / "build.log"
    start = time.monotonic()
    error = None

    def stop(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)  # logged_group stops the build's group on the way out

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        with logged_group(cmd, log, env=env, mode="w") as proc:
            code = proc.wait(timeout=max_seconds)
    except subprocess.TimeoutExpired:
        (build_dir / BUILD_LOCK).unlink(missing_ok=True)  # the stopped build's: ours
        error = f"not finished in {max_seconds:g} s (stopped; log: {log})"
    except SystemExit:
        (build_dir / BUILD_LOCK).unlink(missing_ok=True)
        raise
    else:
        if code != 0:
            error = f"exit {code}: {last_error(log)} (log: {log})"
    finally:
        signal.signal(signal.SIGTERM, previous)
    return Build(time.monotonic() - start, error, build_dir / f"{EXTENSION}.so")


def last_error(log: Path) -> str:
    """What a failed build log says went wrong, in one line: its first compiler error, else
    its last line naming an error, else its last line."""
    lines = [x for x in log.read_text(errors="replace").splitlines()[1:] if x.strip()]  # $ cmd
    compiler = [x for x in lines if re.search(r": (fatal )?error\b", x)]
    errors = [x for x in lines if re.search(r"error", x, re.IGNORECASE)]
    found = compiler[:1] or errors[-1:] or lines[-1:] or ["(empty log)"]
    return one_line(found[0], 300)


def load_extension(library: Path) -> None:
    """Import the built ``library`` as ``fused_layer_norm_cuda`` in this process (the name
    Apex's ``fused_layer_norm.py`` imports)."""
    loader = importlib.machinery.ExtensionFileLoader(EXTENSION, str(library))
    spec = importlib.util.spec_from_file_location(EXTENSION, library, loader=loader)
    extension = importlib.util.module_from_spec(spec)
    loader.exec_module(extension)
    sys.modules[EXTENSION] = extension


def register_apex(snapshot: Snapshot) -> type:
    """Make ``import apex.normalization`` in this process import the snapshot's: its ``apex/``
    becomes the package ``apex``, without Apex's own ``__init__`` (it imports the optimizers
    and more). What the model's ``layernorm_impl`` auto|apex imports then finds it
    (``model.residual.apex_layernorm_class``). Returns its ``FusedLayerNorm``."""
    folder = str(snapshot.root / "apex")
    already = sys.modules.get("apex")
    if already is not None and list(getattr(already, "__path__", [])) != [folder]:
        where = getattr(already, "__file__", None) or list(getattr(already, "__path__", []))
        raise SnapshotError(
            f"--src {snapshot.root}: this process has imported another apex ({where})"
        )
    spec = importlib.machinery.ModuleSpec("apex", None, is_package=True)
    spec.submodule_search_locations = [folder]
    sys.modules["apex"] = importlib.util.module_from_spec(spec)
    module = importlib.import_module("apex.normalization")
    return module.FusedLayerNorm


# --------------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------------


def max_rel(a, b) -> float:
    """max |a - b| / max |b|, in fp32 (0 when both are zero)."""
    a, b = a.detach().float(), b.detach().float()
    scale = float(b.abs().max())
    diff = float((a - b).abs().max())
    return diff / scale if scale > 0 else (0.0 if diff == 0 else math.inf)


def _pair(fused_cls: type, dim: int, dtype, device: str, seed: int = 0):
    """FusedLayerNorm and torch.nn.LayerNorm with the same (random) weight and bias."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    weight = 1 + 0.1 * torch.randn(dim, generator=gen)
    bias = 0.1 * torch.randn(dim, generator=gen)
    pair = (fused_cls(dim, eps=1e-5), torch.nn.LayerNorm(dim, eps=1e-5))
    for m in pair:
        with torch.no_grad():
            m.weight.copy_(weight)
            m.bias.copy_(bias)
        m.to(device=device, dtype=dtype)
    return pair


def _inputs(shape: tuple[int, int], dtype, device: str, seed: int = 1):
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = (2 * torch.randn(shape, generator=gen) + 0.5).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x, dy


def _forward_backward(module, x, dy):
    """(output, d input, d weight, d bias) of one call."""
    import torch

    x = x.detach().requires_grad_()
    y = module(x)
    return (y, *torch.autograd.grad(y, (x, module.weight, module.bias), dy))


DTYPES = ("fp32", "bf16")


def _dtype(name: str):
    import torch

    return {"fp32": torch.float32, "bf16": torch.bfloat16}[name]


def _cases(fused_cls: type, device: str):
    """(dtype name, shape, Apex module, torch module, input, output gradient) for every shape
    of :data:`SHAPES` and dtype of :data:`DTYPES`: what the parity and speed rows compare."""
    for rows_, dim in SHAPES:
        for name in DTYPES:
            fused, ref = _pair(fused_cls, dim, _dtype(name), device)
            x, dy = _inputs((rows_, dim), _dtype(name), device)
            yield name, (rows_, dim), fused, ref, x, dy


def parity_rows(fused_cls: type, device: str) -> list[Row]:
    """FusedLayerNorm against torch.nn.LayerNorm: output and gradients (module docstring)."""
    rows = []
    for name, (rows_, dim), fused, ref, x, dy in _cases(fused_cls, device):
        got, want = _forward_backward(fused, x, dy), _forward_backward(ref, x, dy)
        for what, a, b in zip(("output", "d input", "d weight", "d bias"), got, want, strict=True):
            tol = TOL[name]["output" if what == "output" else "grad"]
            err = max_rel(a, b)
            rows.append(Row(f"parity {name} ({rows_}, {dim}): {what}, max rel diff",
                            f"{err:.1e}", f"{tol:g}", err <= tol))  # fmt: skip
    return rows


def time_calls(calls: dict[str, Callable[[], object]], repeats: int, warmup: int) -> dict:
    """The median microseconds per call of each of ``calls``, by CUDA events around each
    call, the calls alternating; one host sync at the end."""
    import torch

    for _ in range(warmup):
        for fn in calls.values():
            fn()
    events = {name: [] for name in calls}
    for _ in range(repeats):
        for name, fn in calls.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events[name].append((start, end))
    torch.cuda.synchronize()
    return {
        name: 1e3 * statistics.median(s.elapsed_time(e) for s, e in pairs)
        for name, pairs in events.items()
    }


def speed_rows(fused_cls: type, device: str) -> list[Row]:
    """Forward + backward per call, Apex against torch (module docstring)."""
    rows = []
    for name, (rows_, dim), fused, ref, x, dy in _cases(fused_cls, device):
        calls = {
            "apex": functools.partial(_forward_backward, fused, x, dy),
            "torch": functools.partial(_forward_backward, ref, x, dy),
        }
        us = time_calls(calls, REPEATS, WARMUP)
        rows.append(Row(f"speed {name} ({rows_}, {dim}): forward+backward per call, median of "
                        f"{REPEATS}", f"apex {us['apex']:.1f} us, torch {us['torch']:.1f} us "
                        f"(apex/torch {us['apex'] / us['torch']:.2f})"))  # fmt: skip
    return rows


def model_rows(fused_cls: type, device: str) -> list[Row]:
    """The project's model with ``layernorm_impl=apex`` runs the snapshot's class, ``auto``
    picks it on CUDA, and it computes what ``layernorm_impl=torch`` does (module docstring)."""
    import torch

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.data.synthetic import SyntheticData, collate
    from megatron_branchnorm.model import build_model, label_smoothed_nll_loss
    from megatron_branchnorm.model.residual import LayerNorm, describe_layernorm

    results = {}
    for impl in ("apex", "torch"):
        cfg = load_config("tiny_cpu", [*MODEL_OVERRIDES, f"model.layernorm_impl={impl}"])
        batch = collate(SyntheticData(64, cfg.model.vocab_size, 20), list(range(8)))
        model = build_model(cfg.model, cfg.train.seed).to(device)
        logits = model(batch["src_tokens"].to(device), batch["prev_output_tokens"].to(device))
        loss, _, _ = label_smoothed_nll_loss(logits.float(), batch["target"].to(device), 0.1)
        loss.backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        norms = [m for m in model.modules() if isinstance(m, LayerNorm)]
        results[impl] = (logits.detach(), grad, norms)
    norms = results["apex"][2]
    fused = [
        n for n in norms if n.last_backend == "apex" and isinstance(n._apex.get("m"), fused_cls)
    ]
    err_logits = max_rel(results["apex"][0], results["torch"][0])
    err_grad = float((results["apex"][1] - results["torch"][1]).norm() / results["torch"][1].norm())
    auto = describe_layernorm("auto", "cuda")
    return [
        Row("model layernorm_impl=apex: LayerNorms run by the snapshot's FusedLayerNorm",
            f"{len(fused)} of {len(norms)} ({fused_cls.__module__}.{fused_cls.__qualname__})",
            "all", bool(norms) and len(fused) == len(norms)),
        Row("model layernorm_impl=auto on cuda", auto, "apex", "apex FusedLayerNorm" in auto),
        Row("model apex vs torch LayerNorm, fp32: logits, max rel diff", f"{err_logits:.1e}",
            f"{MODEL_TOL:g}", err_logits <= MODEL_TOL),
        Row("model apex vs torch LayerNorm, fp32: gradient, norm of difference / norm",
            f"{err_grad:.1e}", f"{MODEL_TOL:g}", err_grad <= MODEL_TOL),
    ]  # fmt: skip


# --------------------------------------------------------------------------------------------
# The command
# --------------------------------------------------------------------------------------------


def run_check(
    snapshot: Snapshot,
    build_dir: Path | None,
    max_seconds: float,
    emit: Callable[[list[Row]], None],
) -> None:
    """The sections of the module docstring, each one's rows to ``emit`` as it ends; on a
    machine without CUDA one row saying so, and nothing built."""
    import torch

    first = [Row("Apex snapshot", f"commit {snapshot.commit}, {len(snapshot.files)} files")]
    if not torch.cuda.is_available():
        emit([*first, Row("Apex fused LayerNorm", "not run: no CUDA device")])
        return
    device = "cuda"
    torch.cuda.set_device(0)
    arch = arch_list(torch.cuda.get_device_capability())
    jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    first.append(Row("device", f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
                     f"CUDA {torch.version.cuda}"))  # fmt: skip
    build_dir = build_dir or Path(tempfile.mkdtemp(prefix="mbn_apex_build_"))
    built = build_extension(snapshot, build_dir, arch, jobs or 1, max_seconds)
    what = f"build {EXTENSION} (TORCH_CUDA_ARCH_LIST={arch}, MAX_JOBS={jobs})"
    value = f"{built.seconds:.1f} s, in {build_dir}" if built.error is None else built.error
    emit([*first, Row(what, value, f"{max_seconds:g} s", built.error is None)])
    if built.error is not None:
        return
    try:
        load_extension(built.library)
        fused_cls = register_apex(snapshot)
    except ImportError as exc:  # the built library or Apex's Python code does not import
        emit([Row("import the built extension and apex.normalization", one_line(exc, 300),
                  "", False)])  # fmt: skip
        return
    emit(parity_rows(fused_cls, device))
    emit(speed_rows(fused_cls, device))
    emit(model_rows(fused_cls, device))


REPORT_KEYS = frozenset({"tool", "apex_commit", "rows"})
"""The keys of a --json report: how one of ours is recognised."""


def is_our_report(path: Path) -> bool:
    """Whether ``path`` holds a --json report of this tool."""
    data = read_report(path)
    return (
        isinstance(data, dict)
        and set(data) == REPORT_KEYS
        and data["tool"] == TOOL
        and isinstance(data["rows"], list)
        and all(isinstance(r, dict) and set(r) == ROW_KEYS for r in data["rows"])
    )


def check_outputs(src: str, build_dir: str | None, json_path: str | None) -> None:
    """Before anything runs: ``--build-dir`` new, empty or an earlier one of this tool's
    (:data:`BUILD_ENTRIES`), with no build in progress; ``--json`` never inside a directory
    of a known kind, an existing file replaced only when it is a report of ours; neither
    over, inside or around ``--src``."""
    inputs = [("--src", src)]
    if build_dir is not None:
        check_scratch_dir(build_dir, "--build-dir", TOOL, BUILD_ENTRIES, inputs)
        if (Path(build_dir) / BUILD_LOCK).exists():
            raise SnapshotError(
                f"--build-dir {build_dir}: holds {BUILD_LOCK}, left by a build that runs there "
                "or was killed; remove it when none runs, or choose another --build-dir"
            )
    if json_path is not None:
        check_output_file(json_path, "--json", inputs, is_our_report, f"a report of {TOOL} --json")


def main(argv: list[str] | None = None) -> int:
    """Parse, check the snapshot, build and measure, print the table; exit 1 when the build or
    a check failed, 0 when all passed or no CUDA device is there (one row says so)."""
    from megatron_branchnorm.cli import run_main

    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    from megatron_branchnorm.cli import ArgumentParser, float_flag, interrupts_deferred

    parser = ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--src",
        default="apex-src",
        help="the snapshot of tools/apex_snapshot.sh (default apex-src)",
    )
    parser.add_argument("--build-dir", default=None,
                        help="where the extension is built: new, empty or an earlier build "
                        "of this tool (default: a new temporary directory)")  # fmt: skip
    parser.add_argument("--json", default=None, help="also write the rows here")
    parser.add_argument("--max-seconds", type=float_flag(1.0), default=300.0,
                        help="stop the build after this long (default 300)")  # fmt: skip
    args = parser.parse_args(argv)
    check_outputs(args.src, args.build_dir, args.json)
    snapshot = read_snapshot(args.src)
    commit = snapshot.commit
    shown: list[Row] = []
    print(TABLE_HEADER, flush=True)

    def emit(section: list[Row]) -> None:  # each section's rows as it ends (and the JSON)
        shown.extend(section)
        print(format_rows(section), flush=True)
        if args.json:
            report = {"tool": TOOL, "apex_commit": commit, "rows": [r.__dict__ for r in shown]}
            write_text_output(args.json, json.dumps(report, indent=1) + "\n")

    with interrupts_deferred():
        import torch  # noqa: F401 - imported once, Ctrl-C held back

    build_dir = Path(args.build_dir) if args.build_dir else None
    run_check(snapshot, build_dir, args.max_seconds, emit)
    return 0 if all(r.ok is not False for r in shown) else 1


if __name__ == "__main__":
    sys.exit(main())
