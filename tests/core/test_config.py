"""Typed config: shipped configs load, overrides are typed, every bad value names its key."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from megatron_branchnorm.config import (
    CONFIG_DIR,
    ConfigError,
    ExperimentConfig,
    config_from_dict,
    dump_config,
    load_config,
)

SHIPPED = sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def test_the_paper_configs_and_tiny_cpu_are_shipped() -> None:
    for depth in ("12L", "24L", "48L", "200L", "1000L"):
        assert f"opus100_{depth}" in SHIPPED
        assert f"multiun_{depth}" in SHIPPED
    assert "tiny_cpu" in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_config_loads(name: str) -> None:
    cfg = load_config(name)
    assert isinstance(cfg, ExperimentConfig)
    assert cfg.model.residual in ("branchnorm", "deepnorm", "postln", "preln")
    # loading by path gives the same config as loading by name
    assert load_config(CONFIG_DIR / f"{name}.yaml") == cfg


@pytest.mark.parametrize(
    "name, layers", [("opus100_12L", 6), ("opus100_200L", 100), ("multiun_1000L", 500)]
)
def test_paper_depths(name: str, layers: int) -> None:
    m = load_config(name).model
    assert (m.encoder_layers, m.decoder_layers) == (layers, layers)
    assert (m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (512, 2048, 8)


def test_overrides_are_applied_and_typed() -> None:
    cfg = load_config(
        "tiny_cpu",
        [
            "model.hidden_size=128",
            "model.residual=deepnorm",
            "model.dropout=0",
            "model.vocab_size=null",
            "train.lr=3e-4",
            "train.max_steps=20",
            "pipeline.stages=2",
        ],
    )
    assert cfg.model.hidden_size == 128 and type(cfg.model.hidden_size) is int
    assert cfg.model.residual == "deepnorm"
    assert cfg.model.dropout == 0.0 and type(cfg.model.dropout) is float
    assert cfg.model.vocab_size is None
    assert cfg.train.lr == 3e-4 and type(cfg.train.lr) is float
    assert cfg.train.max_steps == 20
    assert cfg.pipeline.stages == 2
    # untouched keys keep the file's values
    assert cfg.model.encoder_layers == load_config("tiny_cpu").model.encoder_layers


def test_exponent_floats_without_a_dot(tmp_path: Path) -> None:
    # PyYAML follows YAML 1.1, where 3e-4 (no dot) is a string: float keys must still take it.
    cfg = load_config("tiny_cpu", ["train.adam_eps=1E-9", "model.dropout=1e-1"])
    assert cfg.train.adam_eps == 1e-9 and cfg.model.dropout == 0.1
    assert load_config(_write(tmp_path, "train:\n  lr: 7e-4\n")).train.lr == 7e-4
    with pytest.raises(ConfigError, match="model.encoder_layers"):
        load_config("tiny_cpu", ["model.encoder_layers=1e3"])  # not an int


def test_overrides_without_a_file_use_the_defaults() -> None:
    cfg = load_config(None, ["model.encoder_layers=3"])
    assert cfg.model.encoder_layers == 3
    assert cfg.model.decoder_layers == ExperimentConfig().model.decoder_layers


def test_dump_and_reload_round_trip(tmp_path: Path) -> None:
    cfg = load_config("tiny_cpu", ["model.residual=postln"])
    dump_config(cfg, tmp_path / "resolved.yaml")
    assert load_config(tmp_path / "resolved.yaml") == cfg
    assert config_from_dict(cfg.to_dict()) == cfg


BAD_OVERRIDES = [
    # (overrides, key that the message must name, a word the message must contain)
    (["model.nonsense=1"], "model.nonsense", "unknown"),
    (["optimizer.lr=1"], "optimizer", "unknown"),
    (["model.encoder_layers=six"], "model.encoder_layers", "int"),
    (["model.encoder_layers=true"], "model.encoder_layers", "bool"),
    (["train.lr=fast"], "train.lr", "float"),
    (["model.hidden_size=100", "model.num_attention_heads=8"], "model.hidden_size", "divisible"),
    (["model.encoder_layers=0"], "model.encoder_layers", ">= 1"),
    (["model.decoder_layers=-2"], "model.decoder_layers", ">= 1"),
    (["model.residual=rezero"], "model.residual", "rezero"),
    (["model.branchnorm_schedule=cosine"], "model.branchnorm_schedule", "cosine"),
    (["model.branch_init=kaiming"], "model.branch_init", "kaiming"),
    (["model.dropout=1.5"], "model.dropout", "[0, 1)"),
    (["model.attention_dropout=-0.1"], "model.attention_dropout", "[0, 1)"),
    (["model.layernorm_impl=fused"], "model.layernorm_impl", "fused"),
    (["pipeline.stages=0"], "pipeline.stages", ">= 1"),
]


@pytest.mark.parametrize("overrides, key, word", BAD_OVERRIDES)
def test_bad_values_raise_one_line_naming_the_key(
    overrides: list[str], key: str, word: str
) -> None:
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", overrides)
    message = str(info.value)
    assert "\n" not in message
    assert key in message
    assert word in message


def test_more_stages_than_layers_is_an_error() -> None:
    # tiny_cpu: 6 + 6 layers, 5 more pipeline entries (embeddings, final norms, output).
    load_config("tiny_cpu", ["pipeline.stages=17"])
    with pytest.raises(ConfigError, match="pipeline.stages") as info:
        load_config("tiny_cpu", ["pipeline.stages=18"])
    assert "\n" not in str(info.value)
    with pytest.raises(ConfigError, match="pipeline.stages"):
        load_config(
            "tiny_cpu", ["model.encoder_layers=1", "model.decoder_layers=1", "pipeline.stages=8"]
        )


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "exp.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_unknown_keys_in_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.hiden_size.*unknown"):
        load_config(_write(tmp_path, "model:\n  hiden_size: 64\n"))
    with pytest.raises(ConfigError, match=r"modle.*unknown"):
        load_config(_write(tmp_path, "modle:\n  hidden_size: 64\n"))


def test_wrong_types_in_a_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.encoder_layers") as info:
        load_config(_write(tmp_path, "model:\n  encoder_layers: '12'\n"))
    assert "str" in str(info.value)
    with pytest.raises(ConfigError, match=r"model\.hidden_size.*bool"):
        load_config(_write(tmp_path, "model:\n  hidden_size: yes\n"))
    with pytest.raises(ConfigError, match=r"model\.encoder_layers.*float"):
        load_config(_write(tmp_path, "model:\n  encoder_layers: 6.5\n"))
    with pytest.raises(ConfigError, match=r"\bmodel\b.*mapping"):
        load_config(_write(tmp_path, "model: 6\n"))


def test_validation_never_rewrites_a_field() -> None:
    cfg = load_config("tiny_cpu", ["model.dropout=0.3", "model.residual=preln"])
    assert cfg.model.dropout == 0.3 and cfg.model.residual == "preln"
    assert cfg.model.branchnorm_steps == load_config("tiny_cpu").model.branchnorm_steps


def test_python_yaml_tags_are_rejected_and_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"model: !!python/object/apply:os.system ['touch {marker}']\n"
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, text))
    assert not marker.exists()
    assert "\n" not in str(info.value)
    assert "exp.yaml" in str(info.value)
    with pytest.raises(ConfigError):
        load_config(_write(tmp_path, "train: !!python/object:builtins.dict {}\n"))


def test_invalid_yaml_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(_write(tmp_path, "model: [unclosed\n"))
    assert "\n" not in str(info.value)
    assert "exp.yaml" in str(info.value)


def test_unknown_config_name_lists_known_names() -> None:
    with pytest.raises(ConfigError) as info:
        load_config("opus100_7L")
    message = str(info.value)
    assert "opus100_7L" in message
    assert "tiny_cpu" in message and "opus100_1000L" in message
    assert "\n" not in message


def test_bad_override_syntax() -> None:
    with pytest.raises(ConfigError, match="hidden_size"):
        load_config("tiny_cpu", ["model.hidden_size"])
    with pytest.raises(ConfigError, match="section.key=value"):
        load_config("tiny_cpu", ["hidden_size=64"])


def test_shipped_yaml_is_plain_safe_yaml() -> None:
    for path in CONFIG_DIR.glob("*.yaml"):
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert set(data) <= {"model", "data", "pipeline", "train"}, path.name
