"""A new residual scheme is one room (docs/design.md §11): two toy schemes, registered at test
time in model/residual.py's SCHEMES and config's RESIDUAL_SCHEMES only, go through the real
trainer (one stage, in this process), convert (the pipeline checkpoint read back as the flat
model) and export, and the Hugging Face export takes or refuses each by its trait."""

from __future__ import annotations

import signal

import pytest
import torch

from megatron_branchnorm import config
from megatron_branchnorm.config import SchemeEntry, load_config
from megatron_branchnorm.data.synthetic import SyntheticData, collate
from megatron_branchnorm.inference.convert import load_pipeline_checkpoint
from megatron_branchnorm.inference.export import load_export, save_export
from megatron_branchnorm.inference.hf_export import HFExportError, export_hf
from megatron_branchnorm.model import residual
from megatron_branchnorm.model.residual import Scheme
from tests.core.helpers import one_rank_process_group

HALF = 0.5


def _half_post(block, x, f):
    """Post-LN with the branch scaled by 1/2: LN(x + F(x) / 2)."""
    return block.norm(torch.add(x, block.dropout(f(x)), alpha=HALF))


def _half_pre(block, x, f):
    """Pre-LN with the branch scaled by 1/2: x + F(LN(x)) / 2, and a final LN per stack."""
    return x + HALF * block.dropout(f(block.norm(x)))


TOYS = {
    "halfpost": (
        Scheme("halfpost", "Half-Post-LN", _half_post, postln_scale=lambda block: HALF),
        SchemeEntry(final_norm=False),
    ),
    "halfpre": (Scheme("halfpre", "Half-Pre-LN", _half_pre), SchemeEntry(final_norm=True)),
}


@pytest.fixture(params=sorted(TOYS))
def toy(request, monkeypatch) -> Scheme:
    """The toy scheme registered where a new scheme goes: its entry in SCHEMES, its name in
    config; nothing else is told of it."""
    scheme, entry = TOYS[request.param]
    monkeypatch.setitem(residual.SCHEMES, scheme.name, scheme)
    monkeypatch.setitem(config.RESIDUAL_SCHEMES, scheme.name, entry)
    residual.check_registry()
    return scheme


def _train(save_dir, scheme: str) -> None:
    """The real trainer for 2 updates of a 1L-1L tiny_cpu model, one stage, in this process."""
    from megatron_branchnorm.training.stop_signals import STOP_SIGNALS
    from megatron_branchnorm.training.trainer import Trainer

    cfg = load_config(
        "tiny_cpu",
        [
            f"model.residual={scheme}",
            "model.encoder_layers=1",
            "model.decoder_layers=1",
            "model.dropout=0.0",
            "pipeline.stages=1",
            "train.max_steps=2",
            "train.save_interval=2",
            "train.eval_interval=0",
            f"train.save_dir={save_dir}",
        ],
    )
    handlers = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}  # the Trainer sets its own
    try:
        with one_rank_process_group():
            assert Trainer(cfg).train() == 0
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_toy_scheme_trains_converts_and_exports(toy: Scheme, tmp_path) -> None:
    _train(tmp_path / "run", toy.name)

    model, meta = load_pipeline_checkpoint(tmp_path / "run")  # convert
    assert meta["tag"] == "global_step2" and model.cfg.residual == toy.name
    assert all(b.scheme is toy for b in model.residual_blocks())
    for final in (model.encoder_final_norm, model.decoder_final_norm):
        assert isinstance(final, torch.nn.Identity) is not toy.final_norm

    batch = collate(SyntheticData(8, model.cfg.vocab_size, 12), list(range(4)))
    src, prev = batch["src_tokens"], batch["prev_output_tokens"]
    layer = model.encoder_layers[0]
    x = torch.randn(2, 5, model.cfg.hidden_size)
    with torch.no_grad():  # the block runs the toy's equation
        assert torch.equal(layer.ffn_block(x, layer.ffn), toy.block(layer.ffn_block, x, layer.ffn))
        ref = model.eval()(src, prev)

    out = save_export(model, tmp_path / "export")
    exported, _, export_meta = load_export(out)
    assert export_meta["scheme"] == toy.name
    assert exported.cfg.residual == ("postln" if toy.foldable_to_postln else toy.name)
    if toy.foldable_to_postln:  # folded: F's output projection carries the factor 1/2
        assert torch.allclose(
            exported.encoder_layers[0].ffn.fc2.weight, HALF * layer.ffn.fc2.weight
        )
    with torch.no_grad():
        got = exported.eval()(src, prev)
    assert (ref - got).abs().max() <= 1e-5 * ref.abs().max()

    if toy.marian_exportable:
        assert export_hf(model, tmp_path / "hf")["max_abs_diff"] <= 1e-4
    else:
        with pytest.raises(HFExportError, match=f"a {toy.label} model has no transformers"):
            export_hf(model, tmp_path / "hf")


def test_the_registry_and_configs_names_must_agree(monkeypatch) -> None:
    """A scheme named in one of the two places only is caught by the import-time check."""
    monkeypatch.setitem(residual.SCHEMES, "halfpost", TOYS["halfpost"][0])
    with pytest.raises(RuntimeError, match="name different schemes"):
        residual.check_registry()
    monkeypatch.setitem(config.RESIDUAL_SCHEMES, "halfpost", TOYS["halfpost"][1])
    residual.check_registry()
    with pytest.raises(config.ConfigError, match="unknown scheme 'nope'"):
        config.validate_model(config.ModelConfig(residual="nope"))
