"""Hugging Face export: MarianMTModel loads it, logits and beam search match ours."""

from __future__ import annotations

import pytest
import torch

from megatron_branchnorm.inference.beam_search import beam_search
from megatron_branchnorm.inference.export import save_export
from megatron_branchnorm.inference.hf_export import HFExportError, export_hf
from megatron_branchnorm.inference.translate import Translator
from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.embedding import sinusoidal_table
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from .helpers import COPY_TAG, copy_batch, tiny_config

transformers = pytest.importorskip("transformers")
transformers.utils.logging.disable_progress_bar()


def _batch(vocab: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(EOS_ID + 1, vocab, (4, 20), generator=gen)
    src[:, -1] = EOS_ID
    src[2, 9:] = PAD_ID
    src[2, 8] = EOS_ID
    prev = torch.randint(EOS_ID + 1, vocab, (4, 24), generator=gen)
    prev[:, 0] = BOS_ID
    return src, prev


@pytest.mark.parametrize("scheme", ["postln", "branchnorm", "deepnorm"])
def test_marian_logits_match(tmp_path, scheme):
    model = build_model(tiny_config(residual=scheme, activation="gelu", branchnorm_steps=50), 7)
    model.set_step(20)
    export = save_export(model, tmp_path / "exp")
    info = export_hf(export, tmp_path / "hf")
    assert info["max_abs_diff"] <= 1e-4 and info["tokenizer"] is False

    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    cfg = hf.config
    assert cfg.scale_embedding and cfg.share_encoder_decoder_embeddings
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id) == (
        PAD_ID,
        EOS_ID,
        BOS_ID,
    )
    assert cfg.activation_function == "gelu"
    assert torch.equal(hf.final_logits_bias, torch.zeros_like(hf.final_logits_bias))
    table = sinusoidal_table(model.cfg.max_positions, model.cfg.hidden_size)
    assert torch.allclose(hf.model.encoder.embed_positions.weight, table, atol=1e-6)
    assert torch.allclose(hf.model.decoder.embed_positions.weight, table, atol=1e-6)
    assert hf.lm_head.weight.data_ptr() == hf.model.shared.weight.data_ptr()

    src, prev = _batch(model.cfg.vocab_size)
    with torch.no_grad():
        ours = model.eval()(src, prev)
        theirs = hf(
            input_ids=src, attention_mask=src.ne(PAD_ID).long(), decoder_input_ids=prev
        ).logits
    assert (ours - theirs).abs().max().item() <= 1e-4


def test_preln_is_refused(tmp_path):
    model = build_model(tiny_config(residual="preln"), 1)
    with pytest.raises(HFExportError, match="Pre-LN"):
        export_hf(model, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


@pytest.mark.filterwarnings("ignore:Recommended. pip install sacremoses")
def test_tokenizer_gives_our_source_ids(tmp_path, text_export):
    export_hf(text_export, tmp_path / "hf")
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    translator = Translator.from_export(text_export)
    for line in ["The cat sits on the mat.", "Open the small window quickly."]:
        assert tok(f">>de<< {line}").input_ids == translator.encode(line, "de")
    ids = translator.sp.encode("The red dog.")
    assert tok.decode(ids + [EOS_ID], skip_special_tokens=True) == "The red dog."


def test_generate_matches_our_beam_search(tmp_path, copy_model):
    export_hf(copy_model, tmp_path / "hf")
    hf = transformers.MarianMTModel.from_pretrained(tmp_path / "hf").eval()
    src, _, _ = copy_batch(8, torch.Generator().manual_seed(5))
    banned = [PAD_ID, BOS_ID, UNK_ID, COPY_TAG]
    max_len = 10
    ours = beam_search(
        copy_model, src, beam=4, lenpen=0.6, max_len_a=0, max_len_b=max_len, banned_ids=banned
    )
    with torch.no_grad():
        out = hf.generate(
            input_ids=src,
            attention_mask=src.ne(PAD_ID).long(),
            num_beams=4,
            length_penalty=0.6,
            max_new_tokens=max_len + 1,
            bad_words_ids=[[b] for b in banned],
            early_stopping=True,
        )
    for h, row in zip(ours, out, strict=True):
        theirs = [t for t in row.tolist()[1:] if t not in (PAD_ID, EOS_ID)]
        assert h[0].tokens == theirs
