"""Exports handed over by someone else: a config.yaml that disagrees with its weights is refused
before anything is built, directions the model never trained are refused, and the Hugging Face
export says a full disk in one line (items 5, 11, 12c)."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from megatron_branchnorm.commands import translate as translate_cmd
from megatron_branchnorm.formats.files import sha256_file
from megatron_branchnorm.inference import export as export_mod
from megatron_branchnorm.inference.export import ExportError, load_export, save_export
from megatron_branchnorm.model import build_model

from .helpers import tiny_config

MAX_INT = 2**31 - 1


@pytest.fixture
def tiny_export(tmp_path) -> Path:
    """A 2L-2L d=32 export (tiny_config) without a SentencePiece model."""
    return save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")


@pytest.fixture
def nothing_built(monkeypatch):
    """Fail if the model is built anywhere but on the meta device, or a tensor is read."""
    real = export_mod.build_model

    def guarded(cfg, seed=1):
        if torch.empty(0).device.type != "meta":
            raise AssertionError(f"model built before config.yaml was checked: {cfg}")
        return real(cfg, seed)

    def no_load(*args, **kwargs):
        raise AssertionError("tensors read before config.yaml was checked")

    monkeypatch.setattr(export_mod, "build_model", guarded)
    monkeypatch.setattr(export_mod, "load_file", no_load)


def _rehash(out: Path, name: str) -> None:
    """Record ``name``'s new sha256 in export.json, as a crafted export would."""
    meta = json.loads((out / "export.json").read_text())
    meta["sha256"][name] = sha256_file(out / name)
    (out / "export.json").write_text(json.dumps(meta))


def _set_config(out: Path, **values) -> None:
    data = yaml.safe_load((out / "config.yaml").read_text())
    data["model"].update(values)
    (out / "config.yaml").write_text(yaml.safe_dump(data))
    _rehash(out, "config.yaml")


def _edit_weights(out: Path, edit) -> None:
    state = load_file(str(out / "model.safetensors"))
    edit(state)
    save_file(state, str(out / "model.safetensors"))
    _rehash(out, "model.safetensors")


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("encoder_layers", 100_000),  # the reported case: 6 GB and climbing before
        ("encoder_layers", 1),
        ("decoder_layers", MAX_INT),
        ("hidden_size", 2**30),
        ("ffn_hidden_size", MAX_INT),
        ("vocab_size", MAX_INT),
        ("max_positions", MAX_INT),  # the position tables are not in the weights
        ("num_attention_heads", MAX_INT),
    ],
)
def test_config_disagreeing_with_weights_is_refused_before_building(
    tiny_export, nothing_built, key, value
):
    _set_config(tiny_export, **{key: value})
    with pytest.raises(ExportError) as info:
        load_export(tiny_export)
    msg = str(info.value)
    assert "\n" not in msg and f"model.{key}" in msg and "config.yaml" in msg, msg


def _reshape(state):
    state["encoder_layers.0.ffn.fc2.bias"] = torch.zeros(31)


def _extra(state):
    state["extra"] = torch.zeros(2)


def _missing(state):
    del state["decoder_layers.1.ffn.fc1.weight"]


def _integer(state):
    state["encoder_layers.1.ffn.fc1.bias"] = torch.zeros(64, dtype=torch.int64)


def _layer_gap(state):
    for name in [n for n in state if n.startswith("encoder_layers.1.")]:
        state[name.replace("encoder_layers.1.", "encoder_layers.7.")] = state.pop(name)


def _no_embedding(state):
    del state["embedding.weight"]


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (_reshape, "tensor encoder_layers.0.ffn.fc2.bias has shape (31,)"),
        (_extra, "unexpected ['extra']"),
        (_missing, "missing ['decoder_layers.1.ffn.fc1.weight']"),
        (_integer, "tensor encoder_layers.1.ffn.fc1.bias has dtype I64"),
        (_layer_gap, "unexpected ['encoder_layers.7."),
        (_no_embedding, "embedding.weight"),
    ],
)
def test_weights_header_disagreeing_with_config_is_refused(
    tiny_export, nothing_built, edit, needle
):
    _edit_weights(tiny_export, edit)
    with pytest.raises(ExportError) as info:
        load_export(tiny_export)
    msg = str(info.value)
    assert "\n" not in msg and "model.safetensors" in msg and needle in msg, msg


def test_hf_export_of_a_crafted_export_is_refused_before_building(
    tiny_export, nothing_built, tmp_path
):
    pytest.importorskip("transformers")
    from megatron_branchnorm.inference.hf_export import export_hf

    _set_config(tiny_export, encoder_layers=9_999)  # within the config's bound of 10,000
    with pytest.raises(ExportError, match=r"config\.yaml: key model\.encoder_layers is 9999"):
        export_hf(tiny_export, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_hf_export_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    transformers = pytest.importorskip("transformers")
    from megatron_branchnorm.inference.hf_export import export_hf

    def full(*args, **kwargs):
        raise SafetensorError(
            'Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No '
            'space left on device" })'
        )

    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file", full)
    out = tmp_path / "out" / "hf"
    out.parent.mkdir()
    with pytest.raises(ExportError) as info:
        export_hf(build_model(tiny_config(), seed=1), out, verify=False)
    assert (
        str(info.value) == f"{out}: cannot write the Hugging Face export: no space left on device"
    )
    assert list(out.parent.iterdir()) == []


# --------------------------------------------------------------------------------------------
# Directions the model was not trained on
# --------------------------------------------------------------------------------------------


def with_directions(text_export: Path, dest: Path, directions: list[str]) -> Path:
    """A copy of ``text_export`` whose export.json records the trained ``directions`` (as
    convert_checkpoint does; export.json is not among the files it hashes)."""
    shutil.copytree(text_export, dest)
    meta = json.loads((dest / "export.json").read_text())
    meta["directions"] = directions
    (dest / "export.json").write_text(json.dumps(meta))
    return dest


def _translate(monkeypatch, capsys, model: Path, src: str, tgt: str, *extra: str):
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"the cat\n"), encoding="utf-8"))
    argv = ["--model", str(model), "--src-lang", src, "--tgt-lang", tgt, "--quiet"]
    code = translate_cmd.main([*argv, "--beam", "1", "--max-len-b", "3", "--threads", "1", *extra])
    return code, *capsys.readouterr()


def test_untrained_direction_is_refused_unless_zero_shot(
    tmp_path, text_export, monkeypatch, capsys
):
    model = with_directions(text_export, tmp_path / "exp", ["de-en", "en-de"])
    for src, tgt in (("en", "en"), ("de", "zh")):
        code, out, err = _translate(monkeypatch, capsys, model, src, tgt)
        assert code == 2 and out == "", err
        assert err.strip().splitlines() == [
            f"error: --src-lang {src} --tgt-lang {tgt}: the model was not trained on "
            f"{src}-{tgt} (trained: de-en, en-de); --zero-shot translates it anyway"
        ]
    code, out, err = _translate(monkeypatch, capsys, model, "de", "zh", "--zero-shot")
    assert code == 0 and len(out.splitlines()) == 1, err
    code, out, err = _translate(monkeypatch, capsys, model, "de", "en")
    assert code == 0, err
    # a language without a tag is refused even on purpose
    code, _, err = _translate(monkeypatch, capsys, model, "en", "fr", "--zero-shot")
    assert code == 2 and "no tag <2fr>" in err and len(err.strip().splitlines()) == 1


def test_export_without_recorded_directions_refuses_a_language_into_itself(
    text_export, monkeypatch, capsys
):
    code, out, err = _translate(monkeypatch, capsys, text_export, "en", "en")
    assert code == 2 and out == ""
    assert "not trained on en-en (no DATA_DIR trains a language into itself)" in err
    assert len(err.strip().splitlines()) == 1
    code, _, err = _translate(monkeypatch, capsys, text_export, "en", "en", "--zero-shot")
    assert code == 0, err


def test_convert_records_the_trained_directions(tmp_path):
    from megatron_branchnorm.inference.convert import trained_directions

    data = tmp_path / "data"
    data.mkdir()
    manifest = data / "manifest.json"
    manifest.write_text(json.dumps({"directions": ["en-de", "de-en"], "languages": ["de", "en"]}))
    tag = tmp_path / "run" / "global_step4"
    tag.mkdir(parents=True)

    def train_config(dataset: str, sha: str | None) -> None:
        info = {"config": {"data": {"dataset": dataset}}, "data_manifest_sha256": sha}
        (tag / "train_config.json").write_text(json.dumps(info))

    train_config(str(data), sha256_file(manifest))
    assert trained_directions(tag) == (["de-en", "en-de"], None)
    train_config("synthetic", None)
    assert trained_directions(tag) == (None, None)
    train_config(str(data), None)  # an older checkpoint: nothing to check the DATA_DIR against
    assert trained_directions(tag) == (None, None)
    train_config(str(data), "0" * 64)  # the DATA_DIR was preprocessed again since
    directions, warning = trained_directions(tag)
    assert directions is None and "another version of" in warning and "\n" not in warning
    train_config(str(tmp_path / "gone"), "0" * 64)
    directions, warning = trained_directions(tag)
    assert directions is None and "gone" in warning and "\n" not in warning
