"""``train_config.json``'s typed record (formats/train_config.py ``TrainConfigRecord``): a real
checkpoint's record round-trips byte for byte and resumes the trainer, an older checkpoint
without the later keys reads with the defaults its readers always had, unknown keys are kept,
and a malformed value is one line naming the file and the key. Nothing outside formats/ reads
the file's raw JSON."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import checkpoint_state, train_config

ROOT = Path(__file__).resolve().parents[2]
SHA = "ab" * 32

TINY_RUN = [
    "pipeline.stages=1",
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "train.micro_batches=2",
    "train.save_interval=2",
    "train.eval_interval=0",
    "train.log_interval=1",
]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> dict:
    """The real trainer (tiny_cpu, one stage, one rank in this process, synthetic data) for 2
    updates, saving ``global_step2``; then a second trainer in the same save_dir that only
    resumes (the same layout: its step, samples and data position come from DeepSpeed's copy
    of the record in the engine file)."""
    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.training.stop_signals import STOP_SIGNALS
    from megatron_branchnorm.training.trainer import Trainer
    from tests.core.helpers import one_rank_process_group

    save_dir = tmp_path_factory.mktemp("record") / "run"
    handlers = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        with one_rank_process_group():
            first = load_config(
                "tiny_cpu", [*TINY_RUN, "train.max_steps=2", f"train.save_dir={save_dir}"]
            )
            assert Trainer(first).train() == 0
            second = load_config(
                "tiny_cpu", [*TINY_RUN, "train.max_steps=4", f"train.save_dir={save_dir}"]
            )
            trainer = Trainer(second)
            trainer.checkpointer.resume()
            resumed = {
                "from": trainer.checkpointer.resumed_from,
                "step": trainer.state.step,
                "samples": trainer.state.samples,
                "sampler": trainer.stream.state_dict(),
                "parts": list(trainer.parts),
            }
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return {"save_dir": save_dir, "tag_dir": save_dir / "global_step2", "resumed": resumed}


# ---- a real checkpoint ------------------------------------------------------------------------


def test_a_real_checkpoints_record_round_trips(real_run, tmp_path):
    tag_dir = real_run["tag_dir"]
    path = tag_dir / ckpt.TRAIN_CONFIG
    record = train_config.read_train_record(tag_dir)
    raw = json.loads(path.read_text())
    assert record.where == path
    assert (record.step, record.data_parallel, record.repartitioned) == (2, 1, False)
    assert record.samples > 0 and record.sampler["position"] >= 0
    assert record.parts == (0, 7) and record.spec_names[0] == "embedding"
    assert record.vocab_recorded and record.vocab is None  # synthetic data: no vocabulary
    assert record.data_manifest_sha256 is None and record.precision.startswith("fp32")
    assert record.config_value("train.max_steps") == 2 and record.config == raw["config"]
    assert record.extra == {}
    assert train_config.saved_data_parallel(tag_dir, record) == 1
    assert train_config.saved_micro_batches(record) == 2
    assert train_config.saved_spec_names(tag_dir, record) == train_config.saved_spec_names(
        tag_dir, raw
    )
    # the JSON object, the record from it, and the file written from the record are the same
    assert json.loads(json.dumps(record.to_json())) == raw
    assert train_config.TrainConfigRecord.from_json(raw, path) == record
    assert train_config.TrainConfigRecord.from_json(path) == record
    train_config.write_train_config(tmp_path, record)
    assert (tmp_path / ckpt.TRAIN_CONFIG).read_bytes() == path.read_bytes()
    # read_checkpoint hands the same record with the weights
    info, state = checkpoint_state.read_checkpoint(tag_dir, lambda name, key: f"{name}.{key}")
    assert info == record and state


def test_a_resume_takes_the_records_position(real_run):
    record = train_config.read_train_record(real_run["tag_dir"])
    assert real_run["resumed"] == {
        "from": "global_step2",
        "step": record.step,
        "samples": record.samples,
        "sampler": record.sampler,
        "parts": list(record.parts),
    }


# ---- older checkpoints and unknown keys -------------------------------------------------------


def _current(**changes) -> dict:
    """A train_config.json object as the trainer writes it today (two stages), changed."""
    info = {
        "step": 4,
        "samples": 96,
        "sampler": {"epoch": 0, "position": 4},
        "spec_names": {"0": "embedding", "1": "encoder_layers.0", "2": "output"},
        "parts": [0, 2, 3],
        "config": {"train": {"micro_batches": 3, "max_steps": 8}, "data": {"dataset": "d"}},
        "vocab": {"spm_sha256": SHA, "vocab_size": 64},
        "data_manifest_sha256": SHA,
        "precision": "bf16, ZeRO-1",
        "data_parallel": 2,
    }
    info.update(changes)
    return {k: v for k, v in info.items() if v is not ...}


def test_an_older_checkpoint_reads_with_the_old_defaults(tmp_path):
    old = _current(vocab=..., data_manifest_sha256=..., precision=..., data_parallel=...)
    train_config.write_train_config(tmp_path, old)
    record = train_config.read_train_record(tmp_path)
    assert not record.vocab_recorded and record.vocab is None  # "predates vocabulary checks"
    assert (record.data_manifest_sha256, record.precision, record.data_parallel) == (None,) * 3
    assert record.repartitioned is False
    assert record.to_json() == {
        **old,
        "spec_names": {0: "embedding", 1: "encoder_layers.0", 2: "output"},
        "data_manifest_sha256": None,  # absent and null read alike
        "precision": None,
        "data_parallel": None,
    }
    # the data-parallel size of a checkpoint that did not record it: its RNG files per stage
    assert train_config.saved_data_parallel(tmp_path, record) is None
    for rank in range(4):
        ckpt.rng_file(tmp_path, rank).write_bytes(b"")
    assert train_config.saved_data_parallel(tmp_path, record) == 2
    assert train_config.saved_micro_batches(record) == 3


def test_null_later_keys_read_as_absent_and_vocab_null_is_synthetic(tmp_path):
    info = _current(vocab=None, data_manifest_sha256=None, precision=None, data_parallel=None)
    record = train_config.TrainConfigRecord.from_json(info, tmp_path / ckpt.TRAIN_CONFIG)
    assert record.vocab_recorded and record.vocab is None
    assert (record.data_manifest_sha256, record.precision, record.data_parallel) == (None,) * 3
    assert json.loads(json.dumps(record.to_json())) == info


def test_a_partial_record_loads_and_names_a_key_only_when_needed(tmp_path):
    """What a reader of a few keys gets (inference/convert.trained_directions reads only the
    config and the manifest's sha256): the missing keys are None until one is needed."""
    train_config.write_train_config(tmp_path, {"config": {"data": {"dataset": "d"}}})
    record = train_config.read_train_record(tmp_path)
    assert record.config_value("data.dataset") == "d"
    assert record.config_value("train.max_steps") is None and record.step is None
    assert train_config.saved_data_parallel(tmp_path, record) is None
    assert train_config.saved_micro_batches(record) is None
    for key, what in (("step", "is missing"), ("spec_names", "is missing or malformed")):
        with pytest.raises(ckpt.CheckpointError) as info:
            record.need(key)
        assert str(info.value) == f"{tmp_path / ckpt.TRAIN_CONFIG}: key {key} {what}"


def test_unknown_keys_are_kept(tmp_path):
    info = _current(future={"a": [1, 2]}, vocab={"spm_sha256": SHA, "vocab_size": 64, "x": 1})
    train_config.write_train_config(tmp_path, info)
    record = train_config.read_train_record(tmp_path)
    assert record.extra == {"future": {"a": [1, 2]}} and record.vocab.extra == {"x": 1}
    out = tmp_path / "again"
    out.mkdir()
    train_config.write_train_config(out, record)
    assert train_config.read_train_config(out) == info


def test_a_relaid_record_says_so(tmp_path):
    from dataclasses import replace

    record = train_config.TrainConfigRecord.from_json(_current(), tmp_path / ckpt.TRAIN_CONFIG)
    relaid = replace(record, parts=(0, 3), repartitioned=True)
    train_config.write_train_config(tmp_path, relaid)
    raw = train_config.read_train_config(tmp_path)
    assert raw["parts"] == [0, 3] and raw["repartitioned"] is True
    assert train_config.read_train_record(tmp_path) == relaid
    assert "repartitioned" not in record.to_json()  # the trainer never writes it


# ---- malformed values -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "key, value, named",
    [
        ("step", "4", "step"),
        ("step", -1, "step"),
        ("step", True, "step"),
        ("step", None, "step"),
        ("samples", 1.5, "samples"),
        ("sampler", [0, 4], "sampler"),
        ("spec_names", {"zero": "embedding"}, "spec_names"),
        ("spec_names", ["embedding"], "spec_names"),
        ("parts", [2, 0], "parts"),
        ("parts", [0], "parts"),
        ("parts", "0,3", "parts"),
        ("config", [], "config"),
        ("config", {"train": 3}, "config.train"),
        ("vocab", "spm.model", "vocab"),
        ("vocab", {"spm_sha256": "abc\ndef"}, "vocab"),
        ("vocab", {"spm_sha256": SHA, "vocab_size": 0}, "vocab.vocab_size"),
        ("data_manifest_sha256", "not a digest", "data_manifest_sha256"),
        ("precision", 16, "precision"),
        ("data_parallel", 0, "data_parallel"),
        ("data_parallel", "2", "data_parallel"),
        ("repartitioned", "yes", "repartitioned"),
    ],
)
def test_a_malformed_value_is_one_line_naming_the_file_and_key(tmp_path, key, value, named):
    train_config.write_train_config(tmp_path, _current(**{key: value}))
    with pytest.raises(ckpt.CheckpointError) as info:
        train_config.read_train_record(tmp_path)
    msg = str(info.value)
    assert isinstance(info.value, UserError) and "\n" not in msg
    assert msg.startswith(f"{tmp_path / ckpt.TRAIN_CONFIG}: key {named} ")


def test_the_vocab_message_is_the_converters(tmp_path):
    """The message convert_checkpoint.py gave a malformed vocab before the record checked it."""
    train_config.write_train_config(tmp_path, _current(vocab={"spm_sha256": "x"}))
    with pytest.raises(ckpt.CheckpointError) as info:
        train_config.read_train_record(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / ckpt.TRAIN_CONFIG}: key vocab must be null or hold spm_sha256 (64 hex "
        "digits), got {'spm_sha256': 'x'}"
    )


# ---- one reader -------------------------------------------------------------------------------


def test_only_formats_reads_the_raw_file():
    """Every reader outside formats/ goes through the record: none reads the raw JSON object
    (``read_train_config``) or names the file to open it itself."""
    package = ROOT / "megatron_branchnorm"
    raw_readers = sorted(
        str(path.relative_to(ROOT))
        for path in package.rglob("*.py")
        if path.parent.name != "formats"
        and ("read_train_config" in path.read_text() or "TRAIN_CONFIG).read" in path.read_text())
    )
    assert raw_readers == []
