"""The ``beam`` section of tools/benchmark.py: beam search sentences/s, ours (and ours at
``--baseline``) vs transformers' generate on our HF export, on random weights or a trained
export's test sentences."""

from __future__ import annotations

import argparse
import shutil
import statistics
import time
from pathlib import Path

from megatron_branchnorm.experiments import bench_models
from megatron_branchnorm.experiments.bench_log import log


def _import_beam_tree(root: str) -> tuple:
    """(ModelConfig, build_model, beam_search) of the package under ``root`` (another git
    revision), beside this tree's (bench_models.import_tree)."""
    names = ["config", "model", "inference.beam_search"]
    config, model, search = bench_models.import_tree(
        root, [f"megatron_branchnorm.{name}" for name in names]
    )
    return config.ModelConfig, model.build_model, search.beam_search


def _beam_random(a: argparse.Namespace):
    """(model, [src batch], banned ids, description): random Post-LN weights, one batch of
    random source sentences (random weights rarely emit EOS: every sentence runs to its
    length limit)."""
    import torch

    from megatron_branchnorm.config import ModelConfig
    from megatron_branchnorm.model import build_model
    from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID

    layers = 6
    cfg = ModelConfig(
        encoder_layers=layers, decoder_layers=layers, hidden_size=a.dim, ffn_hidden_size=a.ffn,
        num_attention_heads=a.heads, vocab_size=a.vocab, residual="postln", dropout=0.0,
        max_positions=128,
    )  # fmt: skip
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    nsent = a.beam_sentences or (16 if a.quick else 32)
    slen = 12 if a.quick else 16
    src = torch.randint(EOS_ID + 1, a.vocab, (nsent, slen), generator=g)
    src[:, -1] = EOS_ID
    desc = (
        f"random weights, {layers}L-{layers}L d={a.dim} vocab={a.vocab}, "
        f"{nsent} random sentences of {slen}"
    )
    return model, [src], [PAD_ID, BOS_ID], desc


def _beam_export(a: argparse.Namespace):
    """(model, [src batch per direction], banned ids, description): a trained export and the
    first ``--beam-sentences`` (0: 32) test sentences of every direction of ``--beam-data``,
    encoded as translate.py encodes them; a direction's sentences are one batch."""
    from megatron_branchnorm.inference.evaluate import references_from_manifest
    from megatron_branchnorm.inference.translate import Translator, pad_sources

    tr = Translator.from_export(a.beam_export)
    per_dir = a.beam_sentences or 32
    batches = []
    for d in references_from_manifest(a.beam_data, "test").values():
        lines = [x for x in d.src_path.read_text(encoding="utf-8").splitlines() if x.strip()]
        batches.append(pad_sources([tr.encode(x, d.tgt_lang) for x in lines[:per_dir]]))
    c = tr.model.cfg
    desc = (
        f"export {a.beam_export} ({c.residual} {c.encoder_layers}L-{c.decoder_layers}L "
        f"d={c.hidden_size} vocab={c.vocab_size}), {sum(map(len, batches))} test sentences of "
        f"{a.beam_data} ({len(batches)} directions, a batch each)"
    )
    return tr.model, batches, tr.banned_ids, desc


def bench_beam(a: argparse.Namespace, work: Path) -> dict:
    """Sentences/s of beam search (beam 4, lenpen 0.6) on the same weights: ours (and with
    ``--baseline``, ours at that revision) and MarianMTModel.generate on our HF export,
    interleaved; figures are medians over ``--beam-reps`` repetitions. Random weights, or with
    ``--beam-export``/``--beam-data`` a trained export on real test sentences."""
    import dataclasses

    import torch
    from transformers import MarianMTModel

    from megatron_branchnorm.inference.beam_search import beam_search, max_lengths
    from megatron_branchnorm.inference.hf_export import export_hf
    from megatron_branchnorm.inference.translate import SearchOptions
    from megatron_branchnorm.tokens import EOS_ID, PAD_ID

    torch.set_num_threads(a.threads)
    if a.beam_export:
        model, batches, banned, desc = _beam_export(a)
    else:
        model, batches, banned, desc = _beam_random(a)
    hf_dir = work / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    export_hf(model, hf_dir, verify=False)
    hf = MarianMTModel.from_pretrained(str(hf_dir)).eval()
    hf.generation_config.max_length = None  # max_new_tokens below sets the limit
    nsent = sum(len(src) for src in batches)
    # Our length limit per sentence (beam_search's defaults, as translate.py's); generate takes
    # one per batch: the longest of ours in it.
    opts = SearchOptions()
    own = [max_lengths(s, opts.max_len_a, opts.max_len_b, model.cfg.max_positions) for s in batches]
    limits = [int(x.max()) for x in own]

    def search_fn(search, net):
        def run() -> list:
            out = []
            for src in batches:
                hyps = search(net, src, beam=4, lenpen=0.6, banned_ids=banned)
                out += [h[0].tokens for h in hyps]
            return out

        return run

    def theirs() -> list:
        out = []
        with torch.no_grad():
            for src, limit in zip(batches, limits, strict=True):
                ids = hf.generate(
                    input_ids=src, attention_mask=src.ne(PAD_ID).long(), num_beams=4,
                    length_penalty=0.6, max_new_tokens=limit + 1, early_stopping=True,
                    do_sample=False, bad_words_ids=[[i] for i in banned],
                )  # fmt: skip
                out += [[t for t in row[1:] if t not in (PAD_ID, EOS_ID)] for row in ids.tolist()]
        return out

    fns = {"ours": search_fn(beam_search, model)}
    if a.base:
        base_config, base_build, base_search = _import_beam_tree(a.base)
        base_model = base_build(base_config(**dataclasses.asdict(model.cfg))).eval()
        base_model.load_state_dict(model.state_dict())
        base_model.set_step(model.step)
        fns["base"] = search_fn(base_search, base_model)
    fns["hf"] = theirs
    times: dict[str, list[float]] = {name: [] for name in fns}
    outs = {name: fn() for name, fn in fns.items()}  # warm-up
    reps = a.beam_reps or (1 if a.quick else 3)
    for rep in range(reps):
        names = list(fns) if rep % 2 == 0 else list(reversed(fns))  # alternate the order
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    res = {
        "config": desc,
        "threads": a.threads,
        "reps": reps,
        "times_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "generated_tokens": {name: sum(map(len, out)) for name, out in outs.items()},
    }
    for name, ts in times.items():
        res[f"{name}_sent_per_s"] = nsent / statistics.median(ts)
    res["ratio"] = res["ours_sent_per_s"] / res["hf_sent_per_s"]
    res["same_as_hf"] = sum(x == y for x, y in zip(outs["ours"], outs["hf"], strict=True))
    res["sentences"] = nsent
    # ours stops a sentence at its own limit, generate at its batch's longest: a sentence that
    # reaches its limit may differ for that reason alone
    res["ours_at_limit"] = sum(
        len(h) >= n for h, n in zip(outs["ours"], torch.cat(own).tolist(), strict=True)
    )
    if "base" in fns:
        res["ratio_base"] = res["base_sent_per_s"] / res["hf_sent_per_s"]
        res["ours_over_base"] = res["ours_sent_per_s"] / res["base_sent_per_s"]
        res["same_as_base"] = outs["ours"] == outs["base"]
    log(f"beam: ours/hf = {res['ratio']:.2f}")
    return res
