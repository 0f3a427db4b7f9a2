"""The export directory: round trip, folding, refusal of missing/corrupt/pickled files."""

from __future__ import annotations

import json
import pickle

import pytest
import torch

from megatron_branchnorm.inference.export import (
    ExportError,
    average_state_dicts,
    export_state_dict,
    load_export,
    save_export,
)
from megatron_branchnorm.model import build_model
from megatron_branchnorm.tokens import BOS_ID, EOS_ID

from .helpers import tiny_config


def _batch(vocab: int = 40, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(EOS_ID + 1, vocab, (3, 9), generator=gen)
    src[:, -1] = EOS_ID
    prev = torch.randint(EOS_ID + 1, vocab, (3, 7), generator=gen)
    prev[:, 0] = BOS_ID
    return src, prev


@pytest.mark.parametrize(
    ("scheme", "tol"), [("postln", 0.0), ("branchnorm", 1e-6), ("deepnorm", 1e-4), ("preln", 0.0)]
)
def test_round_trip_logits(tmp_path, scheme, tol):
    model = build_model(tiny_config(residual=scheme, branchnorm_steps=100), seed=2).eval()
    model.set_step(37)
    out = save_export(model, tmp_path / "exp", None, {"source_checkpoint": "ckpt/global_step37"})
    loaded, sp, meta = load_export(out)
    src, prev = _batch()
    with torch.no_grad():
        diff = (model(src, prev) - loaded(src, prev)).abs().max().item()
    assert diff <= tol
    assert sp is None
    assert meta["scheme"] == scheme and meta["step"] == 37
    assert meta["source_checkpoint"] == "ckpt/global_step37"
    assert meta["residual"] == ("preln" if scheme == "preln" else "postln")
    assert loaded.cfg.residual == meta["residual"]
    if scheme == "branchnorm":
        assert meta["alpha"] == pytest.approx(0.37)
    # The loaded model re-exports to identical bytes: loading loses nothing.
    again = save_export(
        loaded, tmp_path / "again", None, {"source_checkpoint": "ckpt/global_step37"}
    )
    assert (again / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()


def test_round_trip_bit_identical_and_embedding_stored_once(tmp_path):
    model = build_model(tiny_config(), seed=5).eval()
    out = save_export(model, tmp_path / "exp", None, {})
    loaded, _, _ = load_export(out)
    src, prev = _batch()
    with torch.no_grad():
        assert torch.equal(model(src, prev), loaded(src, prev))
    names = list(export_state_dict(model))
    assert sum("embedding" in n for n in names) == 1
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, loaded.state_dict()[name]), name


def test_spm_copied_and_loaded(tmp_path, spm_path):
    import sentencepiece as spm

    vocab = spm.SentencePieceProcessor(model_file=str(spm_path)).get_piece_size()
    model = build_model(tiny_config(vocab_size=vocab), seed=1)
    out = save_export(model, tmp_path / "exp", spm_path, {"languages": ["de", "en"]})
    _, sp, meta = load_export(out)
    assert sp.get_piece_size() == vocab
    assert meta["languages"] == ["de", "en"]
    (out / "spm.model").unlink()
    with pytest.raises(ExportError, match="spm.model"):
        load_export(out)


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    model = build_model(tiny_config(), seed=1)
    out = save_export(model, tmp_path / "exp")
    with pytest.raises(ExportError, match="not empty"):
        save_export(model, out)
    save_export(model, out, overwrite=True)
    assert not list(tmp_path.glob(".exp.tmp-*"))


@pytest.mark.parametrize("name", ["model.safetensors", "config.yaml", "export.json"])
def test_missing_file_is_named(tmp_path, name):
    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    (out / name).unlink()
    with pytest.raises(ExportError, match=name.replace(".", r"\.")):
        load_export(out)


@pytest.mark.parametrize("verify", [True, False])
def test_truncated_weights_are_named(tmp_path, verify):
    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    path = out / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ExportError, match=r"model\.safetensors"):
        load_export(out, verify=verify)


def test_corrupt_yaml_and_json_are_named(tmp_path):
    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    (out / "config.yaml").write_text("model: {hidden_size: [", encoding="utf-8")
    with pytest.raises(ExportError, match=r"config\.yaml"):
        load_export(out, verify=False)
    (out / "export.json").write_text("{", encoding="utf-8")
    with pytest.raises(ExportError, match=r"export\.json"):
        load_export(out)


class _Boom:
    def __reduce__(self):
        return (exec, ("import pathlib; pathlib.Path('PWNED').write_text('x')",))


def test_pickled_payload_is_refused_without_running_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    payload = pickle.dumps({"state_dict": _Boom()})
    (out / "model.safetensors").write_bytes(payload)
    meta = json.loads((out / "export.json").read_text())
    meta["sha256"].pop("model.safetensors")  # get past the checksum to the parser itself
    (out / "export.json").write_text(json.dumps(meta))
    with pytest.raises(ExportError, match=r"model\.safetensors: not a readable safetensors"):
        load_export(out)
    # A pickle passed where the export directory should be is refused too.
    (tmp_path / "model.pt").write_bytes(payload)
    with pytest.raises(ExportError, match="not a directory"):
        load_export(tmp_path / "model.pt")
    assert not (tmp_path / "PWNED").exists()


def test_unknown_config_key_is_named(tmp_path):
    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    text = (out / "config.yaml").read_text() + "  colour: blue\n"
    (out / "config.yaml").write_text(text)
    with pytest.raises(ExportError, match="model.colour"):
        load_export(out, verify=False)


def test_average_state_dicts():
    a = build_model(tiny_config(), seed=1).state_dict()
    b = build_model(tiny_config(), seed=2).state_dict()
    avg = average_state_dicts([a, b])
    for name in a:
        assert torch.allclose(avg[name], (a[name] + b[name]) / 2, atol=1e-7)
    assert average_state_dicts([a])["embedding.weight"].equal(a["embedding.weight"])
    with pytest.raises(ValueError, match="different keys"):
        average_state_dicts([a, {k: v for k, v in b.items() if k != "embedding.weight"}])
    with pytest.raises(ValueError, match="no state dicts"):
        average_state_dicts([])
