"""Corruption matrix: every damaged checkpoint file gives a loud error naming it, on the path the
trainer resumes through and on the converter's; never a silent fallback (fault 4)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.inference.convert import load_pipeline_checkpoint
from tests.faults.common import BASE, TRAIN
from tests.pipeline.conftest import ROOT

pytestmark = pytest.mark.faults

TAG = "global_step12"
FILES = {
    "layer file": "layer_01-model_states.pt",
    "engine/optimizer state, stage 0": "mp_rank_00_model_states.pt",
    "engine/optimizer state, stage 1": "mp_rank_01_model_states.pt",
    "RNG state": "rng_state_rank0001.pt",
    "training state": "train_config.json",
}


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def bitflip(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x10
    path.write_bytes(bytes(data))


def delete(path):
    path.unlink()


DAMAGE = {"truncated": truncate, "bit-flipped": bitflip, "deleted": delete}


@pytest.fixture
def save_dir(fault_harness, tmp_path):
    """A private copy of the reference run's checkpoints (4, 8, 12; latest = 12)."""
    return shutil.copytree(fault_harness / "ref", tmp_path / "ref")


def resume_check(save_dir):
    """What Trainer.maybe_resume does before DeepSpeed reads anything."""
    tag, _ = ckpt.resume_tag(save_dir)
    ckpt.verify_checkpoint(save_dir / tag)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
@pytest.mark.parametrize("what", sorted(FILES))
def test_damaged_file_is_named(save_dir, what, damage):
    path = save_dir / TAG / FILES[what]
    DAMAGE[damage](path)
    with pytest.raises(ckpt.CheckpointError, match=FILES[what]):
        resume_check(save_dir)
    with pytest.raises(ckpt.CheckpointError, match=FILES[what]):
        load_pipeline_checkpoint(save_dir)


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_manifest_is_an_error(save_dir, damage):
    DAMAGE[damage](save_dir / TAG / ckpt.MANIFEST)
    # a flipped bit lands in a JSON key/value: either the manifest or a file it lists is named
    with pytest.raises(ckpt.CheckpointError, match=r"checksums\.json|global_step12/"):
        resume_check(save_dir)


@pytest.mark.parametrize(
    "content,match",
    [
        (None, "missing, but 3 complete checkpoint"),
        (b"", "names ''"),
        (b"\xff\xfe\x00garbage", "unreadable"),
        (b"global_step99", "names 'global_step99'"),
        (b"../../etc", "names '../../etc'"),
    ],
)
def test_bad_latest_is_an_error_not_a_fresh_start(save_dir, content, match):
    latest = save_dir / "latest"
    if content is None:
        latest.unlink()
    else:
        latest.write_bytes(content)
    with pytest.raises(ckpt.CheckpointError, match=match):
        resume_check(save_dir)


def test_latest_naming_a_deleted_checkpoint_is_an_error(save_dir):
    shutil.rmtree(save_dir / TAG)
    with pytest.raises(ckpt.CheckpointError, match="global_step12"):
        resume_check(save_dir)


def test_trainer_refuses_a_corrupt_checkpoint(save_dir):
    """End to end: train.py (one process, weights re-laid per layer) exits 2 naming the file,
    before DeepSpeed or the layer loader reads it."""
    bitflip(save_dir / TAG / "mp_rank_01_model_states.pt")
    overrides = [o for o in BASE if not o.startswith("pipeline.stages")]
    proc = subprocess.run(
        [sys.executable, TRAIN, "--config", "tiny_cpu", *overrides, f"train.save_dir={save_dir}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "mp_rank_01_model_states.pt: checksum mismatch" in last
