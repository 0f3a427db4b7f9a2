"""The ``beam`` section of tools/benchmark.py: beam search sentences/s, ours (and ours at
``--baseline``) vs transformers' generate on our HF export, on random weights or a trained
export's test sentences; with ``--beam-engines`` (a trained export) every engine side by side
(:func:`bench_engines`).

    python tools/benchmark.py --sections beam --beam-export runs/demo/export/final \\
        --beam-data runs/demo/data --beam-engines --beam-sentences 100
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

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
    if getattr(a, "beam_engines", False):
        res["engines"] = bench_engines(a.beam_export, a.beam_data, a.beam_sentences or 32)
        print(res["engines"]["table"], file=sys.stderr)
    return res


ENGINES = ("ours", "hf", "ct2 float32", "ct2 int8")
"""Our beam search; transformers' generate on our Hugging Face export; CTranslate2 exports
(inference/ct2.py) at float32 and int8."""


def _test_sentences(data: str, per_direction: int) -> list[tuple[str, str, list[str], list[str]]]:
    """(src_lang, tgt_lang, sources, references): the first test sentences of each
    direction of ``data`` (non-empty sources)."""
    from megatron_branchnorm.inference.evaluate import references_from_manifest

    out = []
    for d in references_from_manifest(data, "test").values():
        src = d.src_path.read_text(encoding="utf-8").splitlines()
        ref = d.ref_path.read_text(encoding="utf-8").splitlines()
        pairs = [(s, r) for s, r in zip(src, ref, strict=False) if s.strip()][:per_direction]
        out.append((d.src_lang, d.tgt_lang, [s for s, _ in pairs], [r for _, r in pairs]))
    return out


def _hf_translate(hf: Any, tr: Any, lines: list[str], src: str, tgt: str, beam: int) -> list:
    """transformers' generate on our HF export with our ids, limits (the longest of a batch)
    and banned ids, batched as translate.py batches: generated ids per line."""
    import torch

    from megatron_branchnorm.inference.beam_search import max_lengths
    from megatron_branchnorm.inference.translate import SearchOptions, make_batches, pad_sources
    from megatron_branchnorm.tokens import EOS_ID, PAD_ID

    opts = SearchOptions(beam=beam)
    encoded = [tr.encode(x, tgt) for x in lines]
    out: list = [None] * len(lines)
    for batch in make_batches([len(e) for e in encoded], opts.batch_tokens):
        ids = pad_sources([encoded[j] for j in batch])
        positions = tr.model.cfg.max_positions
        limit = int(max_lengths(ids, opts.max_len_a, opts.max_len_b, positions).max())
        with torch.no_grad():
            gen = hf.generate(
                input_ids=ids, attention_mask=ids.ne(PAD_ID).long(), num_beams=beam,
                length_penalty=opts.lenpen, max_new_tokens=limit + 1, early_stopping=True,
                do_sample=False, bad_words_ids=[[i] for i in tr.banned_ids],
            )  # fmt: skip
        for j, row in zip(batch, gen.tolist(), strict=True):
            out[j] = [t for t in row[1:] if t not in (PAD_ID, EOS_ID)]
    return out


def _engine_run(engine: str, paths: dict[str, str], sentences: list, configs: list) -> dict:
    """One engine on every (beam, threads) of ``configs``, in a process of its own (so that
    its peak RSS is its own): seconds (after one untimed pass), sentences, generated tokens
    and BLEU (the mean of the directions' sacreBLEU) per configuration, peak RSS."""
    import torch
    from sacrebleu.metrics import BLEU

    from megatron_branchnorm.inference.ct2 import CT2Translator
    from megatron_branchnorm.inference.translate import SearchOptions, Translator

    base_mb = _rss_mb("VmRSS")
    ours = Translator.from_export(paths["ours"]) if engine in ("ours", "hf") else None
    hf = None
    if engine == "hf":
        from transformers import MarianMTModel

        hf = MarianMTModel.from_pretrained(paths["hf"]).eval()
        hf.generation_config.max_length = None  # max_new_tokens sets the limit
    rows = {}
    for beam, threads in configs:
        torch.set_num_threads(threads)
        tr = ours
        if engine.startswith("ct2"):
            tr = CT2Translator(paths[engine], threads=threads)

        def run(tr: Any = tr, beam: int = beam) -> tuple[list[list[str]], int]:
            texts, tokens = [], 0
            for src, tgt, lines, _ in sentences:
                if hf is not None:
                    ids = _hf_translate(hf, tr, lines, src, tgt, beam)
                else:
                    hyps = tr.translate_hypotheses(lines, src, tgt, SearchOptions(beam=beam))
                    ids = [h[0].tokens for h in hyps]
                tokens += sum(map(len, ids))
                texts.append([tr.decode(x) for x in ids])
            return texts, tokens

        run()  # warm-up
        t0 = time.perf_counter()
        texts, tokens = run()
        seconds = time.perf_counter() - t0
        bleus = [
            BLEU().corpus_score(hyp, [refs]).score
            for hyp, (_, _, _, refs) in zip(texts, sentences, strict=True)
        ]
        rows[f"beam{beam}_t{threads}"] = {
            "beam": beam, "threads": threads, "seconds": round(seconds, 3),
            "sentences": sum(len(x[2]) for x in sentences), "tokens": tokens,
            "bleu": round(statistics.mean(bleus), 2),
        }  # fmt: skip
    peak_mb = _rss_mb("VmHWM")
    return {"rows": rows, "peak_rss_mb": round(peak_mb), "rss_before_load_mb": round(base_mb)}


def _rss_mb(field: str) -> float:
    """This process's resident memory (``VmRSS``) or its peak (``VmHWM``) in MiB, from
    /proc/self/status: unlike ``ru_maxrss``, the peak of a spawned child starts afresh (its own
    address space), not at its parent's. 0 where /proc is not there."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        return 0.0
    for line in status.splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _child(engine: str, paths: dict, sentences: list, configs: list, queue: Any) -> None:
    queue.put(_engine_run(engine, paths, sentences, configs))


def bench_engines(
    export: str,
    data: str,
    per_direction: int,
    isolate: bool = True,
    configs: list[tuple[int, int]] | None = None,
) -> dict:
    """Every engine of :data:`ENGINES` on the same test sentences of ``data`` (the first
    ``per_direction`` of each direction), at each (beam, threads) of ``configs`` (default: beam
    4 and 1, on 1 thread and on all): sentences/s, generated tokens/s, peak RSS (each engine
    in a process of its own with ``isolate``), BLEU; the model files' sizes; a markdown table
    (``table``) with the CPU's flags."""
    import multiprocessing

    from megatron_branchnorm.inference.ct2 import export_ct2
    from megatron_branchnorm.inference.export import SPM, WEIGHTS, load_export
    from megatron_branchnorm.inference.hf_export import export_hf
    from megatron_branchnorm.runner.hardware import cpu_info

    sentences = _test_sentences(data, per_direction)
    cores = os.cpu_count() or 1
    configs = configs or [(beam, t) for beam in (4, 1) for t in sorted({1, cores})]
    res: dict[str, Any] = {"cpu": cpu_info().describe(), "configs": configs, "engines": {}}
    with tempfile.TemporaryDirectory(prefix="mbn_engines_") as tmp:
        model, _, meta = load_export(export)
        spm = Path(export) / SPM
        paths = {"ours": str(export), "hf": f"{tmp}/hf"}
        export_hf(model, paths["hf"], spm, verify=False)
        for q in ("float32", "int8"):
            paths[f"ct2 {q}"] = f"{tmp}/ct2-{q}"
            export_ct2(model, paths[f"ct2 {q}"], spm, meta, quantization=q)
        res["model_bytes"] = {
            "safetensors (ours)": (Path(export) / WEIGHTS).stat().st_size,
            **{f"{e} model.bin": (Path(paths[e]) / "model.bin").stat().st_size
               for e in ENGINES if e.startswith("ct2")},
        }  # fmt: skip
        c = model.cfg
        res["config"] = (
            f"export {export} ({c.encoder_layers}L-{c.decoder_layers}L d={c.hidden_size} "
            f"vocab={c.vocab_size}), {sum(len(x[2]) for x in sentences)} test sentences of "
            f"{data} ({len(sentences)} directions)"
        )
        del model
        ctx = multiprocessing.get_context("spawn")
        for engine in ENGINES:
            log(f"engines: {engine}")
            if not isolate:
                res["engines"][engine] = _engine_run(engine, paths, sentences, configs)
                continue
            queue = ctx.Queue()
            proc = ctx.Process(target=_child, args=(engine, paths, sentences, configs, queue))
            proc.start()
            res["engines"][engine] = queue.get()
            proc.join()
    res["table"] = format_engines(res)
    return res


def format_engines(res: dict) -> str:
    """The markdown table of :func:`bench_engines`' result."""
    lines = [
        f"{res['cpu']}",
        f"{res['config']}",
        "",
        "| engine | beam | threads | sentences/s | target tokens/s | x ours | peak RSS MiB "
        "(over imports) | BLEU |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    ours = res["engines"]["ours"]["rows"]
    for key in ours:
        for engine, r in res["engines"].items():
            row = r["rows"][key]
            tok_s = row["tokens"] / row["seconds"]
            ratio = tok_s / (ours[key]["tokens"] / ours[key]["seconds"])
            lines.append(
                f"| {engine} | {row['beam']} | {row['threads']} | "
                f"{row['sentences'] / row['seconds']:.1f} | {tok_s:.0f} | {ratio:.2f} | "
                f"{r['peak_rss_mb']} ({r['peak_rss_mb'] - r['rss_before_load_mb']:+}) | "
                f"{row['bleu']:.2f} |"
            )
    sizes = ", ".join(f"{k} {v / 2**20:.2f} MiB" for k, v in res["model_bytes"].items())
    lines += ["", f"model files: {sizes}"]
    return "\n".join(lines)
