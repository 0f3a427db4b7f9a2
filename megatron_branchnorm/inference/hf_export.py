"""Export to a Hugging Face ``transformers`` MarianMTModel directory.

    export_hf("exports/run1", "exports/run1-hf")
    model = MarianMTModel.from_pretrained("exports/run1-hf")

A folded (Post-LN) model is a Marian model; the conventions, checked one by one:

| ours | Marian (transformers) |
| --- | --- |
| embeddings scaled by sqrt(d) | ``scale_embedding=True`` |
| sinusoidal positions from 0: channel i < d/2 sin(p w_i), d/2 + i cos(p w_i), w_i = 10000^(-2i/d) | ``MarianSinusoidalPositionalEmbedding`` (same layout; not stored, rebuilt on load) |
| one embedding for encoder, decoder and output | ``share_encoder_decoder_embeddings``, ``tie_word_embeddings``; ``final_logits_bias`` zeros |
| Post-LN blocks, no embedding LayerNorm, no final stack LayerNorm | Marian's layers (``normalize_before`` is not an option there) |
| fused qkv / q + fused kv | q_proj, k_proj, v_proj (row blocks of the fused weight, in that order) |
| LayerNorm eps 1e-5 | ``nn.LayerNorm`` default 1e-5 (other eps: refused) |
| relu / gelu (erf) | ``activation_function`` relu / gelu |
| pad 0, eos 3, decoder start = BOS 2 | ``pad_token_id=0``, ``eos_token_id=3``, ``decoder_start_token_id=2`` |

Pre-LN models are refused: Marian has no pre-norm option, and M2M100 (pre-norm) uses another
sinusoidal table (frequencies 10000^(-i/(d/2-1)), positions offset by padding_idx + 1), so no
existing class computes our Pre-LN function.

The tokenizer: a ``MarianTokenizer`` (source.spm = target.spm = our joint model, vocab.json
mapping every piece to its id, our ``<2xx>`` tags under Marian's multilingual names ``>>xx<<``),
which appends ``</s>``; the target-language tag is written in front of the sentence as Marian's
multilingual models expect: ``tokenizer(">>de<< Hello")`` gives exactly the ids translate.py
feeds the model (``<2de> ▁Hello </s>``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.outputs import (
    OutputError,
    prepare_output,
    publish_dir,
    temp_dir_beside,
    write_marker,
)
from megatron_branchnorm.inference.export import (
    EXPORT_TOOL,
    SPM,
    ExportError,
    load_export,
    write_failure,
)
from megatron_branchnorm.inference.translate import TAG_PATTERN
from megatron_branchnorm.model import EncoderDecoder
from megatron_branchnorm.model.encoder_decoder import as_postln
from megatron_branchnorm.model.residual import scheme_of
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

PARITY_TOLERANCE = 1e-4  # docs/design.md §5: HF export logits vs ours
HF_EXPORT_KIND = dirs.HF_EXPORT.name
"""Marker kind of a Hugging Face export directory (outputs.MARKER; formats/dirs.py owns its
layout)."""


class HFExportError(UserError, ValueError):
    """The model cannot be expressed as a transformers model (one-line reason)."""


def marian_config_dict(model: EncoderDecoder) -> dict[str, Any]:
    """MarianConfig keyword arguments describing ``model`` (a Post-LN model)."""
    c = model.cfg
    return {
        "vocab_size": c.vocab_size,
        "decoder_vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_positions,
        "d_model": c.hidden_size,
        "encoder_layers": c.encoder_layers,
        "decoder_layers": c.decoder_layers,
        "encoder_ffn_dim": c.ffn_hidden_size,
        "decoder_ffn_dim": c.ffn_hidden_size,
        "encoder_attention_heads": c.num_attention_heads,
        "decoder_attention_heads": c.num_attention_heads,
        "activation_function": c.activation,
        "dropout": c.dropout,
        "attention_dropout": c.attention_dropout,
        "activation_dropout": c.activation_dropout,
        "scale_embedding": True,
        "share_encoder_decoder_embeddings": True,
        "tie_word_embeddings": True,
        "pad_token_id": PAD_ID,
        "eos_token_id": EOS_ID,
        "bos_token_id": BOS_ID,
        "decoder_start_token_id": BOS_ID,
        "forced_eos_token_id": EOS_ID,
        "is_encoder_decoder": True,
    }


def _split_rows(t: torch.Tensor, n: int) -> list[torch.Tensor]:
    return [x.clone() for x in t.chunk(n, dim=0)]


def marian_state_dict(model: EncoderDecoder) -> dict[str, torch.Tensor]:
    """Our Post-LN weights under MarianMTModel's parameter names."""
    sd: dict[str, torch.Tensor] = {}
    emb = model.embedding.weight.detach().clone()
    sd["model.shared.weight"] = emb
    sd["model.encoder.embed_tokens.weight"] = emb
    sd["model.decoder.embed_tokens.weight"] = emb
    sd["lm_head.weight"] = emb
    sd["final_logits_bias"] = torch.zeros(1, emb.shape[0])

    def linear(prefix: str, lin: torch.nn.Linear) -> None:
        sd[f"{prefix}.weight"] = lin.weight.detach().clone()
        sd[f"{prefix}.bias"] = lin.bias.detach().clone()

    def norm(prefix: str, block: torch.nn.Module) -> None:
        sd[f"{prefix}.weight"] = block.norm.weight.detach().clone()
        sd[f"{prefix}.bias"] = block.norm.bias.detach().clone()

    def self_attn(prefix: str, attn: torch.nn.Module) -> None:
        ws, bs = _split_rows(attn.qkv.weight.detach(), 3), _split_rows(attn.qkv.bias.detach(), 3)
        for name, w, b in zip(("q_proj", "k_proj", "v_proj"), ws, bs, strict=True):
            sd[f"{prefix}.{name}.weight"], sd[f"{prefix}.{name}.bias"] = w, b
        linear(f"{prefix}.out_proj", attn.out)

    for i, layer in enumerate(model.encoder_layers):
        p = f"model.encoder.layers.{i}"
        self_attn(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.self_attn_block)
        linear(f"{p}.fc1", layer.ffn.fc1)
        linear(f"{p}.fc2", layer.ffn.fc2)
        norm(f"{p}.final_layer_norm", layer.ffn_block)
    for i, layer in enumerate(model.decoder_layers):
        p = f"model.decoder.layers.{i}"
        self_attn(f"{p}.self_attn", layer.self_attn)
        norm(f"{p}.self_attn_layer_norm", layer.self_attn_block)
        cross = layer.cross_attn
        linear(f"{p}.encoder_attn.q_proj", cross.q)
        ws, bs = _split_rows(cross.kv.weight.detach(), 2), _split_rows(cross.kv.bias.detach(), 2)
        for name, w, b in zip(("k_proj", "v_proj"), ws, bs, strict=True):
            sd[f"{p}.encoder_attn.{name}.weight"], sd[f"{p}.encoder_attn.{name}.bias"] = w, b
        linear(f"{p}.encoder_attn.out_proj", cross.out)
        norm(f"{p}.encoder_attn_layer_norm", layer.cross_attn_block)
        linear(f"{p}.fc1", layer.ffn.fc1)
        linear(f"{p}.fc2", layer.ffn.fc2)
        norm(f"{p}.final_layer_norm", layer.ffn_block)
    return sd


def _postln(model: EncoderDecoder) -> EncoderDecoder:
    scheme = scheme_of(model.cfg)
    if not scheme.marian_exportable:
        raise HFExportError(
            f"--format hf: a {scheme.label} model has no transformers equivalent "
            f"({scheme.hf_refusal}); export it with --format native"
        )
    if model.cfg.layernorm_eps != 1e-5:
        raise HFExportError(
            f"--format hf: model.layernorm_eps={model.cfg.layernorm_eps}, but Marian's LayerNorms "
            "use 1e-5"
        )
    return as_postln(model)


def _write_tokenizer(spm_path: Path, out_dir: Path, max_length: int) -> None:
    """MarianTokenizer files: source.spm, target.spm (our joint model), vocab.json."""
    import sentencepiece as spm
    from transformers import MarianTokenizer

    sp = spm.SentencePieceProcessor(model_file=str(spm_path))
    vocab = {}
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        match = TAG_PATTERN.match(piece)
        vocab[f">>{piece[2:-1]}<<" if match else piece] = i  # <2de> -> Marian's >>de<<
    work = out_dir / ".tokenizer-src"
    work.mkdir()
    try:
        shutil.copyfile(spm_path, work / "source.spm")
        shutil.copyfile(spm_path, work / "target.spm")
        (work / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
        tok = MarianTokenizer(
            source_spm=str(work / "source.spm"),
            target_spm=str(work / "target.spm"),
            vocab=str(work / "vocab.json"),
            unk_token=sp.id_to_piece(UNK_ID),
            eos_token=sp.id_to_piece(EOS_ID),
            pad_token=sp.id_to_piece(PAD_ID),
            model_max_length=max_length,
        )
        tok.save_pretrained(str(out_dir))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def export_hf(
    source: str | Path | EncoderDecoder,
    out_dir: str | Path,
    spm_model_path: str | Path | None = None,
    verify: bool = True,
    overwrite: bool = False,
    output_flag: str = "--output",
    inputs: Sequence[tuple[str, str | Path | None]] = (),
) -> dict[str, Any]:
    """Write a MarianMTModel directory (config, safetensors weights, generation config, and a
    MarianTokenizer when a SentencePiece model is known) for an export directory or a model.

    With ``verify`` the directory is loaded back with ``MarianMTModel.from_pretrained`` and its
    logits compared with ours; returns ``{"max_abs_diff": ..., "tokenizer": bool}``. Raises
    HFExportError for a model Marian cannot express or a parity failure. ``out_dir`` must not
    overlap the source export, the SentencePiece model or ``inputs`` (``(flag, path)``) and
    must be absent, empty, or (with ``overwrite``) a directory this function wrote (its
    marker, kind :data:`HF_EXPORT_KIND`); ExportError otherwise, before any work.
    """
    out_dir = Path(out_dir)
    inputs = list(inputs)
    if not isinstance(source, EncoderDecoder):
        inputs.append(("the source export", source))
    if spm_model_path is not None:
        inputs.append(("the SentencePiece model", spm_model_path))
    try:
        prepare_output(out_dir, HF_EXPORT_KIND, overwrite, output_flag, inputs)
    except OutputError as exc:
        raise ExportError(str(exc)) from None
    try:
        from transformers import GenerationConfig, MarianConfig, MarianMTModel
    except ImportError:
        raise HFExportError("--format hf needs transformers (pip install -e .[hf])") from None
    if isinstance(source, EncoderDecoder):
        model = source
    else:
        model, _, _ = load_export(source)
        if spm_model_path is None and (Path(source) / SPM).is_file():
            spm_model_path = Path(source) / SPM
    model = _postln(model).eval()

    try:
        tmp = temp_dir_beside(out_dir, EXPORT_TOOL)
    except OSError as exc:
        raise write_failure(exc, out_dir, "Hugging Face export") from None
    try:
        config = MarianConfig(**marian_config_dict(model))
        hf = MarianMTModel(config).eval()
        missing, unexpected = hf.load_state_dict(marian_state_dict(model), strict=False)
        missing = [k for k in missing if "embed_positions" not in k]
        if missing or unexpected:
            raise HFExportError(
                f"weight map incomplete: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        hf.generation_config = GenerationConfig(
            num_beams=4,
            length_penalty=0.6,
            early_stopping=True,  # fairseq's rule: stop once `num_beams` hypotheses are done
            max_length=model.cfg.max_positions,
            pad_token_id=PAD_ID,
            eos_token_id=EOS_ID,
            bos_token_id=BOS_ID,
            decoder_start_token_id=BOS_ID,
            forced_eos_token_id=EOS_ID,
            bad_words_ids=[[PAD_ID], [BOS_ID], [UNK_ID]],
        )
        hf.save_pretrained(str(tmp))
        has_tokenizer = spm_model_path is not None
        if has_tokenizer:
            _write_tokenizer(Path(spm_model_path), tmp, model.cfg.max_positions)
        diff = check_hf_parity(model, tmp) if verify else float("nan")
        if verify and not diff <= PARITY_TOLERANCE:
            raise HFExportError(
                f"transformers logits differ from ours by {diff:.3g} (> {PARITY_TOLERANCE})"
            )
        write_marker(tmp, EXPORT_TOOL, HF_EXPORT_KIND)
        try:
            prepare_output(out_dir, HF_EXPORT_KIND, overwrite, output_flag, inputs)
        except OutputError as exc:
            raise ExportError(str(exc)) from None
        publish_dir(tmp, out_dir)
    except (OSError, SafetensorError) as exc:  # a full disk: one line, as save_export says it
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, out_dir, "Hugging Face export") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"max_abs_diff": diff, "tokenizer": has_tokenizer}


@torch.no_grad()
def check_hf_parity(model: EncoderDecoder, hf_dir: str | Path, seed: int = 0) -> float:
    """Max |logits(ours) - logits(MarianMTModel.from_pretrained(hf_dir))| on a random padded
    batch (positions up to 16 or the table size)."""
    from transformers import MarianMTModel

    hf = MarianMTModel.from_pretrained(str(hf_dir)).eval()
    gen = torch.Generator().manual_seed(seed)
    vocab = model.cfg.vocab_size
    s_len = t_len = min(16, model.cfg.max_positions)
    src = torch.randint(EOS_ID + 1, vocab, (3, s_len), generator=gen)
    src[:, -1] = EOS_ID
    src[1, s_len // 2 :] = PAD_ID  # one padded row
    src[1, s_len // 2 - 1] = EOS_ID
    prev = torch.randint(EOS_ID + 1, vocab, (3, t_len), generator=gen)
    prev[:, 0] = BOS_ID
    ours = model.eval()(src, prev)
    theirs = hf(input_ids=src, attention_mask=src.ne(PAD_ID).long(), decoder_input_ids=prev).logits
    return float((ours - theirs).abs().max())
