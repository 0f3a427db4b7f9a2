"""megatron_branchnorm.resources: the shipped DeepSpeed JSONs are found by the names the YAMLs,
the docs and the SLURM launchers use, from any working directory; a file that exists wins."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_branchnorm.config import CONFIG_DIR, load_config
from megatron_branchnorm.resources import DS_CONFIG_DIR, find_ds_config

SHIPPED = sorted(p.name for p in DS_CONFIG_DIR.glob("*.json"))


def test_the_shipped_files_are_inside_the_package():
    assert SHIPPED == ["cpu_fp32.json", "zero1_bf16.json", "zero1_fp16.json"]
    assert DS_CONFIG_DIR.parent == Path(__file__).resolve().parents[2] / "megatron_branchnorm"


@pytest.mark.parametrize(
    "value",
    ["ds_configs/cpu_fp32.json", "cpu_fp32.json", "megatron_branchnorm/ds_configs/cpu_fp32.json"],
)
def test_shipped_names_resolve_from_any_directory(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    assert find_ds_config(value) == DS_CONFIG_DIR / "cpu_fp32.json"


def test_an_existing_file_is_taken_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ds_configs").mkdir()
    (tmp_path / "ds_configs" / "cpu_fp32.json").write_text("{}")
    assert find_ds_config("ds_configs/cpu_fp32.json") == Path("ds_configs/cpu_fp32.json")
    absolute = tmp_path / "mine.json"
    absolute.write_text("{}")
    assert find_ds_config(str(absolute)) == absolute


@pytest.mark.parametrize(
    "value", ["ds_configs/nope.json", "other/cpu_fp32.json", "/abs/ds_configs/cpu_fp32.json"]
)
def test_anything_else_is_returned_unchanged(tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    assert find_ds_config(value) == Path(value)


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_yaml_names_a_shipped_json(tmp_path, monkeypatch, path):
    monkeypatch.chdir(tmp_path)
    found = find_ds_config(load_config(path.stem).train.deepspeed_config)
    assert found.parent == DS_CONFIG_DIR and found.is_file()
