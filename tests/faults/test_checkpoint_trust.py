"""A checkpoint is not trusted code (items 1, 2, 12a).

``latest`` and every tag name a ``global_stepN`` directory of the save_dir, never a path or a
link out of it; ``checksums.json`` lists plain file names of its tag and has the shape the
trainer writes; no file of a checkpoint is unpickled beyond tensors and a few DeepSpeed types,
DeepSpeed's own load included. Each refusal is one line naming the file, and a pickle payload
never runs. The resume tests run the trainer in this process on a world of one rank (a tiny
1-stage model: a fraction of a second per fp32 run).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.stop_signals import STOP_SIGNALS
from tests.core.helpers import one_rank_process_group

pytestmark = pytest.mark.faults

TAG = "global_step1"


class Payload:
    """Unpickling this creates ``marker``: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (str(self.marker),))


def config(save_dir: Path, steps: int, ds: str = "cpu_fp32"):
    return load_config(
        "tiny_cpu",
        [
            "pipeline.stages=1",
            "model.encoder_layers=1",
            "model.decoder_layers=1",
            f"train.max_steps={steps}",
            "train.save_interval=1",
            "train.eval_interval=0",
            f"train.deepspeed_config=ds_configs/{ds}.json",
            f"train.save_dir={save_dir}",
        ],
    )


def train(save_dir: Path, steps: int, ds: str = "cpu_fp32"):
    """The trainer, in this process (the world of one rank is the module fixture's)."""
    from megatron_branchnorm.training.trainer import Trainer

    trainer = Trainer(config(save_dir, steps, ds))
    assert trainer.train() == 0
    return trainer


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A process group of one rank for the module; an fp32 and a bf16 + ZeRO-1 run of one
    update (``global_step1``), the bf16 one resumed to 2 updates in its own copy."""
    base = tmp_path_factory.mktemp("trust")
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # the Trainer installs its own
    try:
        with one_rank_process_group():
            train(base / "fp32", 1)
            train(base / "bf16", 1, "zero1_bf16")
            resumed = shutil.copytree(base / "bf16", base / "bf16_resumed")
            trainer = train(resumed, 2, "zero1_bf16")
            yield {
                "fp32": base / "fp32",
                "bf16": base / "bf16",
                "bf16_resumed_from": trainer.checkpointer.resumed_from,
                "bf16_engine": type(trainer.engine.checkpoint_engine).__name__,
            }
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def copy_run(runs, kind: str, tmp_path: Path) -> Path:
    return shutil.copytree(runs[kind], tmp_path / "run", ignore=shutil.ignore_patterns("run.lock"))


def plant_payload(path: Path, marker: Path) -> None:
    """``path`` saved again with a payload beside its state, and its tag's checksums rewritten
    (an attacker rewrites them too)."""
    from megatron_branchnorm.training.checkpoint_engine import allowed_globals

    state = ckpt.load_torch_file(path, map_location="cpu", safe_globals=allowed_globals())
    state["payload"] = Payload(marker)
    torch.save(state, path)
    ckpt.write_manifest(path.parent, ckpt.tag_step(path.parent.name))


def one_line(exc_info) -> str:
    text = str(exc_info.value)
    assert "\n" not in text, text
    return text


# ---- item 1: latest and tags name directories of the save_dir -----------------------------------


def test_the_real_checkpoints_resume_through_the_weights_only_engine(runs):
    """The allowlist is enough for DeepSpeed's bf16 + ZeRO-1 files (fp32 needs no type)."""
    assert runs["bf16_resumed_from"] == TAG
    assert runs["bf16_engine"] == "WeightsOnlyCheckpointEngine"


def test_latest_naming_a_checkpoint_outside_the_run_is_refused(runs, tmp_path):
    """The trainer, in-process: ``latest`` = ../elsewhere/global_step4, which exists."""
    from megatron_branchnorm.training.trainer import Trainer

    run = copy_run(runs, "fp32", tmp_path)
    shutil.copytree(run / TAG, tmp_path / "elsewhere" / "global_step4")
    (run / ckpt.LATEST).write_text("../elsewhere/global_step4")
    with pytest.raises(ckpt.CheckpointError) as exc:
        Trainer(config(run, 2))
    assert "names '../elsewhere/global_step4', not a checkpoint tag" in one_line(exc)


@pytest.fixture
def save_dir(tmp_path) -> Path:
    """global_step2 and global_step4, complete (read_latest does not read the manifest)."""
    save = tmp_path / "save"
    for step in (2, 4):
        (save / ckpt.tag_for(step)).mkdir(parents=True)
        (save / ckpt.tag_for(step) / ckpt.MANIFEST).write_text("{}")
    outside = tmp_path / "elsewhere" / "global_step4"
    outside.mkdir(parents=True)
    (outside / ckpt.MANIFEST).write_text("{}")
    return save


@pytest.mark.parametrize(
    "text",
    [
        "../elsewhere/global_step4",
        "ABSOLUTE",  # the outside directory's absolute path
        "global_step4/../global_step4",
        "./global_step4",
        "global_step4/",
        "global_step04",  # tag_for writes no leading zero: not the tag of step 4
        "global_step 4",
        "global_step4 global_step2",
        "global_step4\x00",
        "global_step\N{ARABIC-INDIC DIGIT FOUR}",
        "",
    ],
)
def test_latest_names_only_a_tag_of_the_save_dir(save_dir, text):
    if text == "ABSOLUTE":
        text = str(save_dir.parent / "elsewhere" / "global_step4")
    if text == "global_step04":
        (save_dir / text).mkdir()
    (save_dir / ckpt.LATEST).write_text(text)
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.resume_tag(save_dir)
    assert f"{save_dir / ckpt.LATEST}: names " in one_line(exc)


@pytest.mark.parametrize("text", ["global_step4", "global_step4\n", " global_step4 \n"])
def test_latest_with_surrounding_whitespace_is_the_tag(save_dir, text):
    """``echo global_step4 > latest`` adds a newline: no part of the name (DeepSpeed strips it
    too)."""
    (save_dir / ckpt.LATEST).write_text(text)
    assert ckpt.resume_tag(save_dir) == ("global_step4", [])


def test_latest_that_is_a_symbolic_link_is_refused_unread(save_dir):
    """Its target's text is never read (nor said in the message)."""
    secret = save_dir.parent / "secret"
    secret.write_text("global_step4 is the tag, and a secret")
    (save_dir / ckpt.LATEST).symlink_to(secret)
    with pytest.raises(ckpt.CheckpointError, match="a symbolic link") as exc:
        ckpt.resume_tag(save_dir)
    assert "secret" not in one_line(exc).replace(str(save_dir), "")


def test_a_tag_that_is_a_symbolic_link_is_refused(save_dir):
    """Named by ``latest``, or the newer complete checkpoint a resume would take instead."""
    outside = save_dir.parent / "elsewhere" / "global_step4"
    shutil.rmtree(save_dir / "global_step4")
    (save_dir / "global_step4").symlink_to(outside, target_is_directory=True)
    (save_dir / ckpt.LATEST).write_text("global_step4")
    with pytest.raises(ckpt.CheckpointError, match="names 'global_step4', a symbolic link") as exc:
        ckpt.resume_tag(save_dir)
    one_line(exc)
    (save_dir / ckpt.LATEST).write_text("global_step2")
    with pytest.raises(ckpt.CheckpointError, match="global_step4: a symbolic link") as exc:
        ckpt.resume_tag(save_dir)
    one_line(exc)
    with pytest.raises(ckpt.CheckpointError, match="global_step4: a symbolic link"):
        ckpt.verify_checkpoint(save_dir / "global_step4")


# ---- item 2 and 12a: checksums.json -------------------------------------------------------------


LISTED = ckpt.layer_file(0)
"""The one file of the ``tag_dir`` fixture (a name a save writes: a manifest lists no other)."""


@pytest.fixture
def tag_dir(tmp_path) -> Path:
    """A tag with one file and its manifest; a secret file beside the save_dir."""
    tag = tmp_path / "save" / "global_step3"
    tag.mkdir(parents=True)
    (tag / LISTED).write_bytes(b"x")
    ckpt.write_manifest(tag, 3)
    (tmp_path / "secret").write_bytes(b"s" * 12345)
    return tag


def rewrite_manifest(tag_dir: Path, change) -> Path:
    path = tag_dir / ckpt.MANIFEST
    manifest = json.loads(path.read_text())
    manifest = change(manifest)
    path.write_text(json.dumps(manifest))
    return path


@pytest.mark.parametrize(
    "name",
    ["../../secret", "../secret", "SECRET_ABSOLUTE", "sub/a.pt", "..", ".", "", "a.pt\x00"],
)
def test_a_manifest_entry_outside_its_tag_is_refused_untouched(tag_dir, monkeypatch, name):
    """With the outside file's true size and checksum listed: refused by its name, the file
    never stat'ed or hashed, its size not said."""
    secret = tag_dir.parent.parent / "secret"
    if name == "SECRET_ABSOLUTE":
        name = str(secret)
    entry = {"sha256": ckpt.sha256_file(secret), "bytes": secret.stat().st_size}

    def add(manifest):
        manifest["files"][name] = entry
        return manifest

    path = rewrite_manifest(tag_dir, add)
    hashed = []
    real_sha256 = ckpt.sha256_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda p: hashed.append(Path(p)) or real_sha256(p))
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(tag_dir)
    line = one_line(exc)
    assert line.startswith(f"{path}: entry ") and "not a plain file name" in line
    assert "12345" not in line and "12,345" not in line
    assert all(p.parent == tag_dir for p in hashed), hashed


def test_a_manifest_entry_that_is_a_symbolic_link_is_refused(tag_dir):
    secret = tag_dir.parent.parent / "secret"
    (tag_dir / ckpt.layer_file(1)).symlink_to(secret)
    entry = {"sha256": ckpt.sha256_file(secret), "bytes": secret.stat().st_size}

    def add(manifest):
        manifest["files"][ckpt.layer_file(1)] = entry
        return manifest

    path = rewrite_manifest(tag_dir, add)
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(tag_dir)
    assert one_line(exc) == (
        f"{path}: entry {ckpt.layer_file(1)!r} is a symbolic link; a checkpoint's files are its own"
    )


def _set(key, value):
    def change(manifest):
        manifest[key] = value
        return manifest

    return change


def _entry(key, value):
    def change(manifest):
        entry = manifest["files"][LISTED]
        if value is KeyError:
            del entry[key]
        else:
            entry[key] = value
        return manifest

    return change


MALFORMED = {
    "a list": lambda m: [m],
    "a string": lambda m: "checksums",
    "a number": lambda m: 3,
    "null": lambda m: None,
    "no files": lambda m: {"step": 3},
    "files a list": _set("files", [[LISTED, "0" * 64, 1]]),
    "files a string": _set("files", LISTED),
    "files null": _set("files", None),
    "an entry a number": _set("files", {LISTED: 1}),
    "an entry a list": _set("files", {LISTED: ["0" * 64, 1]}),
    "an entry null": _set("files", {LISTED: None}),
    "no sha256": _entry("sha256", KeyError),
    "no bytes": _entry("bytes", KeyError),
    "sha256 a number": _entry("sha256", 5),
    "sha256 a list": _entry("sha256", ["0" * 64]),
    "sha256 too short": _entry("sha256", "abc"),
    "sha256 not hex": _entry("sha256", "z" * 64),
    "bytes a string": _entry("bytes", "1"),
    "bytes a float": _entry("bytes", 1.0),
    "bytes a bool": _entry("bytes", True),
    "bytes negative": _entry("bytes", -1),
    "bytes null": _entry("bytes", None),
    "no step": lambda m: {"files": m["files"]},
    "step a string": _set("step", "3"),
    "step negative": _set("step", -3),
}


def test_every_malformed_manifest_is_one_line_naming_it(tag_dir):
    pristine = (tag_dir / ckpt.MANIFEST).read_text()
    for what, change in MALFORMED.items():
        (tag_dir / ckpt.MANIFEST).write_text(pristine)
        path = rewrite_manifest(tag_dir, change)
        with pytest.raises(ckpt.CheckpointError) as exc:
            ckpt.verify_checkpoint(tag_dir)
        assert one_line(exc).startswith(f"{path}: "), what
    (tag_dir / ckpt.MANIFEST).write_text(pristine)
    assert set(ckpt.verify_checkpoint(tag_dir)["files"]) == {LISTED}


# ---- item 1: nothing unpickled beyond weights --------------------------------------------------


def test_a_pickle_payload_in_the_engine_file_is_refused_not_run(runs, tmp_path):
    """The trainer, in-process, resumes at the checkpoint's layout (DeepSpeed's load): the
    payload is refused before any file is read, on every rank alike (checksums rewritten)."""
    run = copy_run(runs, "fp32", tmp_path)
    engine_file = run / TAG / ckpt.engine_file(0)
    marker = tmp_path / "pwned"
    plant_payload(engine_file, marker)
    with pytest.raises(ckpt.CheckpointError) as exc:
        train(run, 2)
    assert one_line(exc).startswith(f"{engine_file}: refused: it would unpickle posix.mkdir")
    assert not marker.exists()


@pytest.mark.parametrize(
    "kind, name",
    [
        ("fp32", ckpt.engine_file(0)),
        ("fp32", ckpt.layer_file(1)),  # PipelineModule.load_state_dir
        ("bf16", ckpt.optim_file(0, 0, bf16=True)),  # the BF16 optimizer's load
        ("fp32", "rng_state_rank0000.pt"),  # ours
    ],
)
def test_every_file_deepspeed_loads_is_read_weights_only(runs, tmp_path, monkeypatch, kind, name):
    """Past the checks before the load (left out here), DeepSpeed's own load refuses the
    payload too: each kind of file it reads goes through the weights-only checkpoint engine."""
    run = copy_run(runs, kind, tmp_path)
    path = run / TAG / name
    marker = tmp_path / "pwned"
    plant_payload(path, marker)
    monkeypatch.setattr(ckpt, "verify_checkpoint", lambda tag_dir: {})
    with pytest.raises(ckpt.CheckpointError) as exc:
        train(run, 2, "zero1_bf16" if kind == "bf16" else "cpu_fp32")
    assert one_line(exc).startswith(f"{path}: refused: ")
    assert "posix.mkdir" in one_line(exc)
    assert not marker.exists()


def test_the_allowlist_names_the_types_it_admits():
    """Each qualified name of ALLOWED_GLOBALS is the one torch checks and pickles carry."""
    from megatron_branchnorm.training.checkpoint_engine import allowed_globals

    found = [f"{t.__module__}.{t.__qualname__}" for t in allowed_globals()]
    assert found == list(ckpt.ALLOWED_GLOBALS)


def test_another_deepspeed_checkpoint_engine_is_refused():
    """A DeepSpeed JSON choosing another engine (checkpoint.writer) would load with its own
    pickles: refused, naming the JSON."""
    from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine

    from megatron_branchnorm.training.checkpoint_engine import install_checkpoint_engine

    class Other(TorchCheckpointEngine):
        pass

    engine = SimpleNamespace(checkpoint_engine=Other())
    with pytest.raises(ConfigError, match=r"ds\.json: DeepSpeed's Other is not supported"):
        install_checkpoint_engine(engine, "ds.json")
