"""A throwaway Python environment holding the anchors we benchmark against: fairseq 0.12.2
and torchscale 0.3.0 (beside torch 2.13 CPU). Never inside the repository, never in .venv.

    python tools/_bench_anchors.py --prepare      # builds it if missing; prints its python

Where it lives: ``$MBN_ANCHOR_DIR`` or ``~/.cache/megatron_branchnorm/anchors``; ``venv/`` is
the environment, ``status.json`` says which anchors import (and why not, when one fails).

What it takes to run the anchors on Python 3.11 with torch 2.13 (all done here, in the
throwaway environment only):

- fairseq 0.12.2 ships only a source distribution. Its config dataclasses use mutable
  defaults (``X: FooConfig = FooConfig()``), which Python 3.11 rejects: in
  ``fairseq/dataclass/configs.py`` and ``fairseq/models/transformer/transformer_config.py``
  they become ``field(default_factory=FooConfig)``, and ``dataclass/initialize.py``'s
  ``hydra_init`` reads the factory. It pins hydra-core<1.1 and omegaconf<2.1, which do not
  install on 3.11: we install hydra-core 1.3.2 and omegaconf 2.3.0 and fairseq with
  ``--no-deps`` (its torchaudio requirement is unused by the translation model). Loading a
  fairseq checkpoint with torch >= 2.6 needs ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD=1``
  (:data:`ANCHOR_ENV` sets it). Its sdist lacks the C++ sources of its torch extensions
  (``fairseq/clib/libbase/balanced_assignment.cpp``, ``examples/operators/*``): setup.py
  skips them (only the Cython data helpers are built; the translation model needs none). At
  inference a loaded encoder layer takes the "BetterTransformer" fast path
  (``torch._transformer_encoder_layer_fwd``) without the mask type that torch >= 2 requires
  ("Mask Type should be defined"): ``fairseq/modules/transformer_layer.py`` no longer marks a
  loaded layer for it, so encoder and layers keep the plain path.
- torchscale 0.3.0 imports ``timm.models.layers.drop_path``; timm imports torchvision, which
  fails beside the CPU torch. A stub ``timm`` package (drop_path only; unused at
  drop_path_rate 0) goes into the environment instead. fairscale 0.4.0 installs with
  ``--no-deps``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ANCHOR_DIR = Path(
    os.environ.get("MBN_ANCHOR_DIR", Path.home() / ".cache" / "megatron_branchnorm" / "anchors")
)
ANCHOR_ENV = {"TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"}
"""Environment variables to set when running the anchors' python."""
VERSION = "4"  # bump to rebuild the environment
TORCH_WHEEL_DIR = Path("/opt/wheels")

TIMM_STUB = '''"""Stub of timm for torchscale 0.3.0 (real timm imports torchvision, which fails beside
the CPU torch). Only drop_path exists; torchscale uses it only at drop_path_rate > 0."""
'''
TIMM_LAYERS_STUB = """import torch


def drop_path(x, drop_prob: float = 0.0, training: bool = False, scale_by_keep: bool = True):
    if drop_prob == 0.0 or not training:
        return x
    keep = 1.0 - drop_prob
    mask = x.new_empty((x.shape[0],) + (1,) * (x.ndim - 1)).bernoulli_(keep)
    return x * mask / keep if scale_by_keep else x * mask
"""


def _run(cmd: list[str], log) -> None:
    log.write(f"$ {' '.join(map(str, cmd))}\n")
    log.flush()
    subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)


def patch_fairseq_source(root: Path) -> list[str]:
    """Make fairseq 0.12.2's sources importable on Python 3.11 (see the module docstring);
    returns the files changed."""
    changed = []
    mutable = re.compile(r"^(\s+\w+: (\w+)) = (?:field\(default=)?\2\(\)\)?[ \t]*$", re.M)
    for rel in ("fairseq/dataclass/configs.py", "fairseq/models/transformer/transformer_config.py"):
        path = root / rel
        text = path.read_text()
        new = mutable.sub(r"\1 = field(default_factory=\2)", text)
        if (
            "from dataclasses import" in new
            and "field" not in new.split("from dataclasses import")[1].split("\n")[0]
        ):
            new = new.replace("from dataclasses import ", "from dataclasses import field, ", 1)
        if new != text:
            path.write_text(new)
            changed.append(rel)
    setup = root / "setup.py"
    text = setup.read_text()
    skip = "    from torch.utils import cpp_extension\n"
    if skip in text:  # the sdist lacks the C++ sources (libbase, alignment_train); unused here
        setup.write_text(text.replace(skip, skip + "    raise ImportError('no C++ extensions')\n"))
        changed.append("setup.py")
    init = root / "fairseq/dataclass/initialize.py"
    text = init.read_text()
    old = "        v = FairseqConfig.__dataclass_fields__[k].default\n"
    new_line = (
        "        f = FairseqConfig.__dataclass_fields__[k]\n"
        "        v = f.default_factory() if f.default_factory is not MISSING else f.default\n"
    )
    if old in text:
        text = text.replace(old, new_line).replace(
            "import logging\n", "import logging\nfrom dataclasses import MISSING\n", 1
        )
        init.write_text(text)
        changed.append("fairseq/dataclass/initialize.py")
    layer = root / "fairseq/modules/transformer_layer.py"
    text = layer.read_text()
    bt = "        self.load_to_BT = True\n"
    if bt in text:  # the BetterTransformer path omits the mask type torch >= 2 requires
        layer.write_text(
            text.replace(bt, "        self.load_to_BT = False  # patched: no BT path\n")
        )
        changed.append("fairseq/modules/transformer_layer.py")
    return changed


def _venv_python(root: Path) -> Path:
    return root / "venv" / "bin" / "python"


def prepare_anchor_env(force: bool = False) -> Path:
    """Build (once) the throwaway environment with fairseq 0.12.2 and torchscale 0.3.0 beside
    torch 2.13 CPU, and return its python. Idempotent: a finished environment is reused.

    Each anchor's outcome (``"ok"`` or the error) is in ``ANCHOR_DIR/status.json``; a failed
    anchor does not fail the preparation (the benchmark reports it and goes on). Run the
    returned python with :data:`ANCHOR_ENV` added to the environment.
    """
    root = ANCHOR_DIR
    py = _venv_python(root)
    marker = root / f"ready-{VERSION}"
    if marker.exists() and py.exists() and not force:
        return py
    root.mkdir(parents=True, exist_ok=True)
    status: dict[str, str] = {}
    with open(root / "prepare.log", "a") as log:
        base = getattr(sys, "_base_executable", sys.executable)
        if not py.exists():
            _run([base, "-m", "venv", str(root / "venv")], log)
        pip = [str(py), "-m", "pip", "install", "--disable-pip-version-check", "-q"]
        wheels = sorted(TORCH_WHEEL_DIR.glob("torch-2.13.0*cp311*.whl"))
        torch_req = str(wheels[0]) if wheels else "torch==2.13.0"
        _run(
            [
                *pip,
                torch_req,
                "numpy",
                "setuptools",
                "wheel",
                "cython",
                "cffi",
                "regex",
                "sacrebleu",
                "tqdm",
                "bitarray",
                "hydra-core==1.3.2",
                "omegaconf==2.3.0",
            ],
            log,
        )
        try:
            src = root / "src"
            src.mkdir(exist_ok=True)
            sdist = src / "fairseq-0.12.2.tar.gz"
            if not sdist.exists():
                _run(
                    [
                        str(py),
                        "-m",
                        "pip",
                        "download",
                        "--no-deps",
                        "--no-binary",
                        "fairseq",
                        "fairseq==0.12.2",
                        "-d",
                        str(src),
                    ],
                    log,
                )
            tree = src / "fairseq-0.12.2"
            if not tree.exists():
                with tarfile.open(sdist) as tar:
                    tar.extractall(src, filter="data")
            log.write(f"patched: {patch_fairseq_source(tree)}\n")
            _run([*pip, "--no-deps", "--no-build-isolation", str(tree)], log)
            _run([str(py), "-c", "import fairseq.models.transformer"], log)
            status["fairseq"] = "ok"
        except Exception as e:  # noqa: BLE001 - reported, the other anchors go on
            status["fairseq"] = f"failed: {e} (see {root / 'prepare.log'})"
        try:
            _run([*pip, "--no-deps", "fairscale==0.4.0", "torchscale==0.3.0"], log)
            site = Path(
                subprocess.check_output(
                    [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    text=True,
                ).strip()
            )
            stub = site / "timm" / "models"
            stub.mkdir(parents=True, exist_ok=True)
            (site / "timm" / "__init__.py").write_text(TIMM_STUB)
            (stub / "__init__.py").write_text("")
            (stub / "layers.py").write_text(TIMM_LAYERS_STUB)
            _run([str(py), "-c", "import torchscale.architecture.encoder_decoder"], log)
            status["torchscale"] = "ok"
        except Exception as e:  # noqa: BLE001
            status["torchscale"] = f"failed: {e} (see {root / 'prepare.log'})"
    (root / "status.json").write_text(json.dumps(status, indent=1))
    marker.write_text(json.dumps(status))
    return py


def anchor_status() -> dict[str, str]:
    """Which anchors the prepared environment holds ({} when not prepared)."""
    path = ANCHOR_DIR / "status.json"
    return json.loads(path.read_text()) if path.exists() else {}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prepare", action="store_true", help="build the env; print its python")
    parser.add_argument("--force", action="store_true", help="rebuild even if ready")
    args = parser.parse_args()
    if not args.prepare:
        parser.error("nothing to do (use --prepare)")
    py = prepare_anchor_env(force=args.force)
    print(json.dumps(anchor_status()), file=sys.stderr)
    print(py)


if __name__ == "__main__":
    main()
