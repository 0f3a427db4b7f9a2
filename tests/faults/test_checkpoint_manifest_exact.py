"""A checkpoint's tag directory is exactly what its ``checksums.json`` lists.

A checkpoint may come from someone else or sit in a shared run directory. DeepSpeed's resume
finds a layer's files by glob (``layer_01-*model_states.pt``) and our readers used to parse a
directory listing, where ``layer_001-`` and ``layer_0001-`` are index 1 too: a file dropped
into the tag, or a link to a file outside the run, was read. Every reader now takes the names
the manifest lists; the manifest lists only the names a save writes; and any other entry of
the tag (a file, a FIFO, a link, a directory, a dot-file) is refused in one line naming it
before any file of the tag is read. The trainer runs in this process on a world of one rank
(the module fixture of test_checkpoint_trust.py), the converter through its ``main``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import checkpoint_state
from megatron_branchnorm.training import checkpoint_engine
from tests.faults import test_checkpoint_trust as trust
from tests.faults.test_checkpoint_trust import TAG, config, copy_run, one_line

pytestmark = pytest.mark.faults

runs = trust.runs
"""An fp32 and a bf16 + ZeRO-1 run of one update in a world of one rank (this module's own)."""


@pytest.fixture
def reads(monkeypatch) -> list[Path]:
    """Every checkpoint file hashed, or loaded through DeepSpeed's weights-only engine or our
    torch-file reader, recorded in order; nothing is stopped."""
    seen: list[Path] = []
    sha256, load = ckpt.sha256_file, ckpt.load_torch_file
    layer = checkpoint_state.read_layer_file
    monkeypatch.setattr(ckpt, "sha256_file", lambda p: seen.append(Path(p)) or sha256(p))
    monkeypatch.setattr(ckpt, "load_torch_file", lambda p, *a: seen.append(Path(p)) or load(p, *a))
    monkeypatch.setattr(
        checkpoint_state, "read_layer_file", lambda p: seen.append(Path(p)) or layer(p)
    )
    return seen


@pytest.fixture
def deepspeed_reads(monkeypatch) -> list[str]:
    """DeepSpeed's load of any file fails the test at once (an AssertionError, never a read):
    a refusal must come before DeepSpeed opens anything, and an unlisted FIFO it would open
    would block the test forever."""
    seen: list[str] = []

    def load(self, path, map_location=None):
        seen.append(str(path))
        raise AssertionError(f"DeepSpeed read {path} before the checkpoint was refused")

    monkeypatch.setattr(checkpoint_engine.WeightsOnlyCheckpointEngine, "load", load)
    return seen


def convert(capsys, *args) -> tuple[int, list[str]]:
    """``convert_checkpoint``'s exit status and stderr lines."""
    code = convert_cmd.main([str(a) for a in args])
    return code, capsys.readouterr().err.splitlines()


def resume(run: Path, capsys) -> tuple[int, list[str]]:
    """train.py's exit status and stderr lines for a run resuming ``run`` (``run_main``: a
    UserError is one line and exit 2)."""
    from megatron_branchnorm.training.trainer import Trainer

    code = run_main(lambda argv: Trainer(config(run, 2)).train(), None)
    return code, capsys.readouterr().err.splitlines()


def other_weights(run: Path, where: Path) -> Path:
    """A copy of layer 1's file with other weights, at ``where`` (outside the tag or in it)."""
    state = torch.load(run / TAG / ckpt.layer_file(1), weights_only=True)
    torch.save({k: v + 1.0 if v.is_floating_point() else v for k, v in state.items()}, where)
    return where


def unlisted_line(path: Path, what: str) -> str:
    return (
        f"error: {path}: {what} that {ckpt.MANIFEST} does not list; a checkpoint holds only the "
        "files its save wrote (move it out of the tag)"
    )


# ---- what a real save leaves -------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fp32", "bf16"])
def test_a_real_save_leaves_exactly_what_its_manifest_lists(runs, kind):
    """No temporary file survives a complete save, so a tag holds its manifest and the files it
    lists, each a name a save writes: the rule refuses nothing a save wrote."""
    tag_dir = runs[kind] / TAG
    listed = set(ckpt.verify_checkpoint(tag_dir)["files"])
    assert sorted(os.listdir(tag_dir)) == sorted(listed | {ckpt.MANIFEST})
    assert all(ckpt.is_saved_name(name) for name in listed), listed
    assert ckpt.layer_file(1) in listed and ckpt.engine_file(0) in listed


# ---- unlisted entries: refused by name, before anything is read --------------------------------


@pytest.mark.parametrize("target", ["a layer file", "another file"])
def test_convert_refuses_an_unlisted_link_to_a_file_outside_the_run(
    runs, tmp_path, capsys, reads, target
):
    """``layer_0001-model_states.pt`` linked out of the run: exported (a layer file), or the
    other file's key names said in the error; now one line naming the link, nothing read."""
    run = copy_run(runs, "fp32", tmp_path)
    outside = tmp_path / "outside.pt"
    if target == "a layer file":
        other_weights(run, outside)
    else:
        torch.save({"private_key_name": torch.ones(2)}, outside)
    link = run / TAG / "layer_0001-model_states.pt"
    link.symlink_to(outside)
    out = tmp_path / "export"
    code, err = convert(capsys, "--checkpoint", run, "--output", out)
    assert (code, err) == (2, [unlisted_line(link, "a symbolic link")])
    assert "private_key_name" not in err[0]
    assert reads == [] and not out.exists()


def test_convert_refuses_a_layer_file_dropped_into_a_shared_run(runs, tmp_path, capsys, reads):
    """A regular ``layer_001-model_states.pt`` replaced ``encoder_layers.0`` in the export,
    exit 0, with the checksums "verified"; the re-layout copied it likewise."""
    run = copy_run(runs, "fp32", tmp_path)
    dropped = other_weights(run, run / TAG / "layer_001-model_states.pt")
    for extra in ([], ["--repartition", "1"]):
        out = tmp_path / f"out{len(extra)}"
        code, err = convert(capsys, "--checkpoint", run, "--output", out, *extra)
        assert (code, err) == (2, [unlisted_line(dropped, "a file")])
        assert not out.exists()
    assert reads == []


def test_resume_refuses_an_unlisted_fifo_before_opening_anything(
    runs, tmp_path, capsys, reads, deepspeed_reads
):
    """An unlisted FIFO ``layer_01-a-model_states.pt`` hung the resume forever (DeepSpeed's
    glob takes it and opens it). Refused from the directory listing: the FIFO, and every other
    file, is never opened (``deepspeed_reads`` fails the test at DeepSpeed's first read, so it
    cannot hang without the rule)."""
    run = copy_run(runs, "fp32", tmp_path)
    fifo = run / TAG / "layer_01-a-model_states.pt"
    os.mkfifo(fifo)
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(run / TAG)  # reads only listed files: cannot block on the FIFO
    assert f"error: {one_line(exc)}" == unlisted_line(fifo, "a FIFO")
    assert reads == []
    assert resume(run, capsys) == (2, [unlisted_line(fifo, "a FIFO")])
    assert reads == [] and deepspeed_reads == []


def test_resume_refuses_an_unlisted_copy_of_a_layer_file(
    runs, tmp_path, capsys, reads, deepspeed_reads
):
    """``layer_01-x-model_states.pt``: DeepSpeed's AssertionError traceback, exit 1; now one line,
    exit 2, before DeepSpeed reads anything."""
    run = copy_run(runs, "fp32", tmp_path)
    copy = run / TAG / "layer_01-x-model_states.pt"
    shutil.copyfile(run / TAG / ckpt.layer_file(1), copy)
    assert resume(run, capsys) == (2, [unlisted_line(copy, "a file")])
    assert reads == [] and deepspeed_reads == []


@pytest.mark.parametrize(
    "name, make",
    [
        ("layer_0001-model_states.pt", "link inside"),  # a second name of layer 1's file
        ("notes.txt", "file"),
        (".nfs000000000001", "file"),  # a dot-file: no complete save leaves one
        (".checksums.json.tmp", "file"),
        ("layer_02-model_states.pt.d", "directory"),
        ("mp_rank_01_model_states.pt", "fifo"),
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "link outside"),
        ("bad\nname", "file"),
    ],
)
def test_every_unlisted_entry_is_refused_by_name_unread(runs, tmp_path, reads, name, make):
    run = copy_run(runs, "fp32", tmp_path)
    path = run / TAG / name
    what = {
        "file": "a file",
        "directory": "a directory",
        "fifo": "a FIFO",
        "link inside": "a symbolic link",
        "link outside": "a symbolic link",
    }[make]
    if make == "file":
        path.write_bytes(b"x")
    elif make == "directory":
        path.mkdir()
    elif make == "fifo":
        os.mkfifo(path)
    elif make == "link inside":
        path.symlink_to(ckpt.layer_file(1))
    else:
        (tmp_path / "outside").write_bytes(b"x")
        path.symlink_to(tmp_path / "outside")
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(run / TAG)
    line = one_line(exc)
    where = str(path) if name.isprintable() else f"{run / TAG}: entry {name!r}"
    assert line.startswith(f"{where}: {what} that {ckpt.MANIFEST} does not list"), line
    assert reads == []


# ---- the manifest lists only the names a save writes -----------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "layer_001-model_states.pt",
        "layer_0001-model_states.pt",
        "layer_01-x-model_states.pt",
        "layer_1-model_states.pt",
        "mp_rank_0_model_states.pt",
        "mp_rank_000_model_states.pt",
        "zero_pp_rank_00_mp_rank_00_optim_states.pt",
        "bf16_zero_pp_rank_0_mp_rank_0_optim_states.pt",
        "rng_state_rank0.pt",
        "rng_state_rank00000.pt",
        ".hidden",
        "notes.txt",
        ckpt.MANIFEST,
        "train_config.json.bak",
    ],
)
def test_a_manifest_listing_a_name_no_save_writes_is_refused(runs, tmp_path, reads, name):
    """The file is there, listed with its true checksum by a rewritten manifest: refused by
    the manifest's entry, nothing read. ``layer_001-`` beside ``layer_01-`` would be two names
    for one index."""
    run = copy_run(runs, "fp32", tmp_path)
    tag_dir = run / TAG
    manifest_path = tag_dir / ckpt.MANIFEST
    manifest = json.loads(manifest_path.read_text())
    if name != ckpt.MANIFEST:
        (tag_dir / name).write_bytes(b"x")
    manifest["files"][name] = {"sha256": hashlib.sha256(b"x").hexdigest(), "bytes": 1}
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ckpt.CheckpointError) as exc:
        ckpt.verify_checkpoint(tag_dir)
    assert one_line(exc).startswith(
        f"{manifest_path}: entry {name!r} is not a file a save writes"
    ), one_line(exc)
    assert reads == []
    with pytest.raises(ckpt.CheckpointError, match="is not a file a save writes"):
        ckpt.layer_files(tag_dir)  # a reader that skips the checksums takes no other names


def test_write_manifest_refuses_a_tag_holding_what_no_save_writes(tmp_path):
    """A manifest over a stray entry would be a complete checkpoint its own check refuses."""
    tag_dir = tmp_path / "save" / "global_step3"
    tag_dir.mkdir(parents=True)
    (tag_dir / ckpt.layer_file(0)).write_bytes(b"x")
    for stray in ("layer_001-model_states.pt", ".nfs000000000001"):
        (tag_dir / stray).write_bytes(b"x")
        with pytest.raises(ckpt.CheckpointError) as exc:
            ckpt.write_manifest(tag_dir, 3)
        assert one_line(exc).startswith(f"{tag_dir / stray}: a file that no save writes")
        assert not (tag_dir / ckpt.MANIFEST).exists()
        (tag_dir / stray).unlink()
    ckpt.write_manifest(tag_dir, 3)
    assert set(ckpt.verify_checkpoint(tag_dir)["files"]) == {ckpt.layer_file(0)}


def test_a_save_that_finds_a_stray_entry_stays_incomplete(runs, tmp_path, monkeypatch, capsys):
    """A file appearing in the tag during the save: the run stops with one line, the tag has no
    manifest and ``latest`` still names the last complete checkpoint."""
    from megatron_branchnorm.training import checkpointer

    run = copy_run(runs, "fp32", tmp_path)
    write = checkpointer.train_config.write_train_config

    def write_and_drop(tag_dir, record):
        write(tag_dir, record)
        (Path(tag_dir) / "notes.txt").write_text("mine")

    monkeypatch.setattr(checkpointer.train_config, "write_train_config", write_and_drop)
    code, err = resume(run, capsys)
    new = run / ckpt.tag_for(2)
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: checkpoint {new} not saved: {new / 'notes.txt'}: a file ")
    assert not (new / ckpt.MANIFEST).exists()
    assert (new / "notes.txt").read_text() == "mine"
    assert (run / ckpt.LATEST).read_text() == TAG


# ---- every reader takes the listed names --------------------------------------------------------


def test_readers_take_the_listed_names_not_a_directory_listing(runs, tmp_path):
    """Even a read that skips the checksums (resume in another layout, after its own check)
    reads layer 1 from ``layer_01-model_states.pt``, never from another name of index 1."""
    from megatron_branchnorm.inference.convert import read_checkpoint

    run = copy_run(runs, "bf16", tmp_path)
    tag_dir = run / TAG
    _, before = read_checkpoint(tag_dir)
    other_weights(run, tag_dir / "layer_001-model_states.pt")
    os.mkfifo(tag_dir / "zero_pp_rank_1_mp_rank_00_optim_states.pt")  # never opened
    assert ckpt.layer_files(tag_dir)[1] == tag_dir / ckpt.layer_file(1)
    _, after = read_checkpoint(tag_dir, verify=False)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert checkpoint_state.optim_files(tag_dir) == {
        0: {0: tag_dir / ckpt.optim_file(0, 0, bf16=True)}
    }


def test_valid_bleu_reads_no_linked_train_config(runs, tmp_path):
    """The companion read ``train_config.json`` (its data.dataset) before any check: a link to
    another run's record chose what was scored. Now one line naming the manifest's entry."""
    from megatron_branchnorm.inference import valid_bleu

    run = copy_run(runs, "fp32", tmp_path)
    record = run / TAG / ckpt.TRAIN_CONFIG
    other = json.loads(record.read_text())
    other["config"]["data"]["dataset"] = str(tmp_path / "someone_elses_data")
    (tmp_path / "other.json").write_text(json.dumps(other))
    record.unlink()
    record.symlink_to(tmp_path / "other.json")
    with pytest.raises(ckpt.CheckpointError) as exc:
        valid_bleu.pending_checkpoints(run, valid_bleu.WatchOptions())
    assert one_line(exc) == (
        f"{run / TAG / ckpt.MANIFEST}: entry 'train_config.json' is a symbolic link; a "
        "checkpoint's files are its own"
    )
    with pytest.raises(ckpt.CheckpointError, match="is a symbolic link"):
        valid_bleu.run_finished(run)
