"""Untrusted files and the invalid-config table (faults 8, 9).

Untrusted: a pickle payload as a checkpoint layer file or as an export's weights is refused and
never executed; a ``!!python`` YAML tag is refused; an export missing a tensor is refused.
Configs: every rule of the config and pipeline validators rejects a bad value with a message
naming the key, in pure code before any process group exists; every shipped config passes.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from megatron_branchnorm.config import CONFIG_DIR, ConfigError, load_config
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.inference.convert import load_pipeline_checkpoint
from megatron_branchnorm.inference.export import ExportError, load_export, save_export
from megatron_branchnorm.parallel.partition import partition_plan

pytestmark = pytest.mark.faults


class Payload:
    """Unpickling this writes a marker file: proof that code ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def write_payload(path: Path, marker: Path) -> None:
    path.write_bytes(pickle.dumps({"weight": Payload(marker)}))


@pytest.fixture
def export_dir(fault_harness, tmp_path) -> Path:
    model, meta = load_pipeline_checkpoint(fault_harness / "ref")
    return save_export(model, tmp_path / "export", meta=meta)


def test_pickle_layer_file_is_refused_not_run(fault_harness, tmp_path):
    save_dir = shutil.copytree(fault_harness / "ref", tmp_path / "ref")
    tag_dir = save_dir / "global_step12"
    marker = tmp_path / "pwned"
    write_payload(tag_dir / "layer_01-model_states.pt", marker)
    ckpt.write_manifest(tag_dir, 12)  # the attacker rewrites the checksums too
    with pytest.raises(ckpt.CheckpointError, match="layer_01-model_states.pt: cannot read layer"):
        load_pipeline_checkpoint(save_dir)
    assert not marker.exists()


@pytest.mark.parametrize("verify", [True, False])
def test_pickle_as_export_weights_is_refused_not_run(export_dir, tmp_path, verify):
    marker = tmp_path / "pwned"
    write_payload(export_dir / "model.safetensors", marker)
    with pytest.raises(ExportError, match="model.safetensors"):
        load_export(export_dir, verify=verify)
    assert not marker.exists()


def test_export_with_a_missing_tensor_is_refused(export_dir):
    weights = export_dir / "model.safetensors"
    state = load_file(str(weights))
    dropped = sorted(state)[-1]
    del state[dropped]
    save_file(state, str(weights))
    meta = json.loads((export_dir / "export.json").read_text())
    meta["sha256"].pop("model.safetensors")  # even with its checksum entry gone
    (export_dir / "export.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=rf"missing \['{dropped}'\]"):
        load_export(export_dir)


def test_python_yaml_tag_is_refused(tmp_path, export_dir):
    marker = tmp_path / "pwned"
    evil = f'!!python/object/apply:os.system ["touch {marker}"]\n'
    cfg = tmp_path / "evil.yaml"
    cfg.write_text("model:\n  hidden_size: " + evil)
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(cfg)
    with pytest.raises(ConfigError, match="model.hidden_size"):
        load_config("tiny_cpu", [f"model.hidden_size={evil.strip()}"])
    (export_dir / "config.yaml").write_text("model: " + evil)
    with pytest.raises(ExportError, match="config.yaml"):
        load_export(export_dir, verify=False)
    assert not marker.exists()


# ---- the invalid-config table ---------------------------------------------------------------

INVALID = [
    ("model.encoder_layers=0", "model.encoder_layers"),
    ("model.decoder_layers=-1", "model.decoder_layers"),
    ("model.hidden_size=0", "model.hidden_size"),
    ("model.ffn_hidden_size=0", "model.ffn_hidden_size"),
    ("model.num_attention_heads=0", "model.num_attention_heads"),
    ("model.num_attention_heads=5", "model.hidden_size"),
    ("model.vocab_size=4", "model.vocab_size"),
    ("model.residual=rezero", "model.residual"),
    ("model.branchnorm_schedule=cosine", "model.branchnorm_schedule"),
    ("model.branchnorm_steps=0", "model.branchnorm_steps"),
    ("model.dropout=1.0", "model.dropout"),
    ("model.attention_dropout=-0.1", "model.attention_dropout"),
    ("model.activation_dropout=2", "model.activation_dropout"),
    ("model.activation=swish", "model.activation"),
    ("model.layernorm_impl=fast", "model.layernorm_impl"),
    ("model.layernorm_eps=0", "model.layernorm_eps"),
    ("model.max_positions=1", "model.max_positions"),
    ("model.hidden_size=big", "model.hidden_size"),
    ("model.dropout=true", "model.dropout"),
    ("model.depth=12", "model.depth"),
    ("data.dataset=", "data.dataset"),
    ("data.max_tokens=0", "data.max_tokens"),
    ("data.max_tokens=20", "data.max_tokens"),
    ("data.sampling_temperature=0", "data.sampling_temperature"),
    ("data.max_length=0", "data.max_length"),
    ("data.max_length=200", "data.max_length"),
    ("data.synthetic_size=0", "data.synthetic_size"),
    ("pipeline.stages=0", "pipeline.stages"),
    ("pipeline.stages=40", "pipeline.stages"),
    ("pipeline.partition=", "pipeline.partition"),
    ("pipeline.activation_checkpoint_interval=-1", "pipeline.activation_checkpoint_interval"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.max_time_minutes=-1", "train.max_time_minutes"),
    ("train.micro_batches=0", "train.micro_batches"),
    ("train.lr=0", "train.lr"),
    ("train.warmup_steps=-1", "train.warmup_steps"),
    ("train.warmup_init_lr=-1", "train.warmup_init_lr"),
    ("train.adam_beta1=1", "train.adam_beta1"),
    ("train.adam_beta2=-0.5", "train.adam_beta2"),
    ("train.adam_eps=0", "train.adam_eps"),
    ("train.weight_decay=-1", "train.weight_decay"),
    ("train.label_smoothing=1", "train.label_smoothing"),
    ("train.clip_grad=-1", "train.clip_grad"),
    ("train.save_dir=", "train.save_dir"),
    ("train.save_interval=-1", "train.save_interval"),
    ("train.eval_interval=-1", "train.eval_interval"),
    ("train.log_interval=0", "train.log_interval"),
    ("train.deepspeed_config=", "train.deepspeed_config"),
    ("train.max_consecutive_skips=0", "train.max_consecutive_skips"),
    ("train.collective_timeout_s=0", "train.collective_timeout_s"),
    ("train.seed=1.5", "train.seed"),
    ("nosection.key=1", "nosection"),
    ("train=1", "train"),
]


@pytest.mark.parametrize("override,key", INVALID)
def test_invalid_config_is_rejected_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key {key}|override"):
        load_config("tiny_cpu", [override])


PARTITIONS = [
    ("E e*6 | d*6 L | E", "pipeline.partition"),  # E twice
    ("E e*6 d*5 | L", "pipeline.partition"),  # a decoder layer missing
    ("E e*6 | | d*6 L", "pipeline.partition"),  # empty stage
    ("E e*6 | x*6 L", "pipeline.partition"),  # bad token
]


@pytest.mark.parametrize("layout,key", PARTITIONS)
def test_invalid_stage_layout_is_rejected(layout, key):
    cfg = load_config("tiny_cpu", [f"pipeline.partition={layout}"])
    with pytest.raises(ConfigError, match=key):
        partition_plan(cfg.model, len(layout.split("|")), layout)


def test_more_stages_than_weighted_layers_is_rejected():
    cfg = load_config("tiny_cpu", ["model.encoder_layers=1", "model.decoder_layers=1"])
    with pytest.raises(ConfigError, match="pipeline.stages"):
        partition_plan(cfg.model, 5)


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("*.yaml")))
def test_shipped_configs_are_valid(name):
    cfg = load_config(name)
    assert partition_plan(cfg.model, cfg.pipeline.stages, cfg.pipeline.partition)
