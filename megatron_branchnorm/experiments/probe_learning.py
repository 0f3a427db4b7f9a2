"""How fast does a setting learn to translate? Train the flat model (one process, CPU or GPU)
for a number of updates per variant of a config, and follow the validation NLL, how much the
source is worth (NLL with the sources shuffled minus NLL with the true source) and, at the end,
BLEU/chrF by beam search on the first test sentences of every direction.

The batches, the loss normalisation, AdamW, the inverse-sqrt schedule, BranchNorm's t and
gradient clipping are the trainer's; only the pipeline is left out (it computes the same loss
and gradients: tests/pipeline). Updates are what a CPU budget buys, so a variant that learns
in fewer updates (at the same tokens per update) learns in less time; use it to choose demo
settings (docs/demo.md), on a GPU when one is at hand:

    python tools/probe_learning.py --config demo_cpu --data runs/demo/data --updates 1500 \
        --variant base= --variant lr3e-3=train.lr=3e-3 \
        --variant postln=model.residual=postln --jobs 2 --output probe.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing as mp
import os
import sys
import time
from pathlib import Path

import torch

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.config import load_config
from megatron_branchnorm.data import BatchSampler, TranslationData
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.experiments.analysis import source_dependence
from megatron_branchnorm.formats.files import read_small_file
from megatron_branchnorm.formats.outputs import check_output_file, write_text_output
from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.loss import label_smoothed_nll_loss
from megatron_branchnorm.training.lr_schedule import inverse_sqrt_factor


class ProbeError(UserError, ValueError):
    """A bad --variant (a one-line message)."""


def parse_variant(text: str) -> tuple[str, list[str]]:
    """``name=key=value;key=value`` (or ``name=`` for the config as it is) -> (name, overrides)."""
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise ProbeError(f"--variant {text!r}: expected NAME=key=value;key=value (or NAME=)")
    return name, [x for x in rest.split(";") if x]


def to_device(batch: dict, device: str) -> dict:
    return {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}


def bleu_at(model, data_dir: str, sentences: int, beam: int) -> dict:
    """Beam search on the first ``sentences`` test lines of every direction: the §10 report."""
    import sentencepiece as spm

    from megatron_branchnorm.inference.evaluate import (
        evaluate,
        pivot_language,
        references_from_manifest,
        select_directions,
    )
    from megatron_branchnorm.inference.translate import SearchOptions, Translator

    sp = spm.SentencePieceProcessor(model_file=str(Path(data_dir) / "spm.model"))
    translator = Translator(model, sp)
    directions = select_directions(references_from_manifest(data_dir, "test"), None)
    report = evaluate(
        translator, directions, SearchOptions(beam=beam), False, None, sentences,
        pivot_language(data_dir),
    )  # fmt: skip
    model.train()
    return report


def run_variant(job: dict) -> list[dict]:
    """Train one variant; returns its records (also printed as JSON lines)."""
    torch.set_num_threads(job["threads"])
    name, device = job["name"], job["device"]
    cfg = load_config(job["config"], [f"data.dataset={job['data']}", *job["overrides"]])
    torch.manual_seed(cfg.train.seed)
    train = TranslationData(cfg.data.dataset, "train", max_length=cfg.data.max_length)
    dev = TranslationData(cfg.data.dataset, "dev", max_length=None)
    if cfg.model.vocab_size is None:  # from the manifest, as the trainer does
        cfg = dataclasses.replace(
            cfg, model=dataclasses.replace(cfg.model, vocab_size=train.vocab_size)
        )
    valid = [
        to_device(b, device)
        for b in list(BatchSampler(dev, 2048, 1.0, 1, shuffle=False))[: job["valid_batches"]]
    ]
    model = build_model(cfg.model, cfg.train.seed).to(device)
    t = cfg.train
    opt = torch.optim.AdamW(
        model.parameters(), lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps,
        weight_decay=t.weight_decay,
    )  # fmt: skip
    sched = torch.optim.lr_scheduler.LambdaLR(opt, inverse_sqrt_factor(cfg))
    batches = iter(BatchSampler(train, cfg.data.max_tokens, cfg.data.sampling_temperature, t.seed))
    records, start, tokens = [], time.time(), 0
    for step in range(1, job["updates"] + 1):
        model.train()
        alpha = model.set_step(step)
        micro = [to_device(next(batches), device) for _ in range(t.micro_batches)]
        ntok = sum(b["ntokens"] for b in micro)
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)  # read when logged
        for b in micro:
            logits = model(b["src_tokens"], b["prev_output_tokens"])
            loss, _, _ = label_smoothed_nll_loss(logits, b["target"], t.label_smoothing)
            (loss / ntok).backward()
            loss_sum += loss.detach().double()
            tokens += b["ntokens"] + b["src_ntokens"]
        norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), t.clip_grad if t.clip_grad > 0 else float("inf")
        )
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % job["eval_every"] == 0 or step == job["updates"]:
            model.eval()
            sd = source_dependence(model, valid)
            rec = {
                "variant": name, "step": step, "loss": float(loss_sum) / ntok, "alpha": alpha,
                "grad_norm": float(norm), "valid_nll": sd["true"],
                "source_gain": sd["shuffled"] - sd["true"], "seconds": time.time() - start,
            }  # fmt: skip
            if step in job["bleu_steps"] and job["bleu_sentences"] > 0:
                rep = bleu_at(model, cfg.data.dataset, job["bleu_sentences"], job["beam"])
                rec["bleu"] = rep["averages"]["all"]
                rec["bleu_dirs"] = {k: v["bleu"] for k, v in rep["directions"].items()}
                rec["chrf"] = sum(v["chrf"] for v in rep["directions"].values()) / len(
                    rep["directions"]
                )
            if not math.isfinite(rec["loss"]):
                rec["diverged"] = True
            print(json.dumps(rec), flush=True)
            records.append(rec)
            if rec.get("diverged"):
                break
    return records


MAX_RECORDS_BYTES = 64 << 20
"""Largest --output :func:`is_our_records` reads (one line an evaluation)."""


def is_our_records(path: Path) -> bool:
    """Whether ``path`` holds an --output of ours: JSON lines, each an object with the
    ``variant`` and ``step`` of a record."""
    try:
        lines = read_small_file(path, MAX_RECORDS_BYTES).decode("utf-8").splitlines()
        rows = [json.loads(line) for line in lines if line.strip()]
    except (OSError, ValueError):  # FileShapeError, UnicodeDecodeError too
        return False
    return bool(rows) and all(isinstance(r, dict) and {"variant", "step"} <= set(r) for r in rows)


def _probe(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="demo_cpu", help="config name or YAML path")
    p.add_argument("--data", required=True, help="preprocessed DATA_DIR")
    p.add_argument("--variant", action="append", default=[], help="NAME=key=value;key=value")
    p.add_argument("--updates", type=int, default=1000)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--valid-batches", type=int, default=10, help="dev batches of 2048 tokens")
    p.add_argument("--bleu-sentences", type=int, default=100, help="0: no BLEU at the end")
    p.add_argument("--bleu-at", default="", help="comma-separated updates for BLEU (default: last)")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--jobs", type=int, default=1, help="variants trained at once")
    p.add_argument("--threads", type=int, default=0, help="torch threads per job (0: cores/jobs)")
    p.add_argument("--output", help="JSON lines of every record")
    a = p.parse_args(argv)
    if a.output is not None:  # before any training: never over an input or another's file
        inputs = [("--data", a.data), ("--config", a.config)]
        check_output_file(a.output, "--output", inputs, is_our_records, "records of probe_learning")
    variants = [parse_variant(v) for v in a.variant] or [("base", [])]
    for _, overrides in variants:  # fail before any training starts
        load_config(a.config, [f"data.dataset={a.data}", *overrides])
    threads = a.threads or max(1, len(os.sched_getaffinity(0)) // a.jobs)
    jobs = [
        {
            "name": n,
            "overrides": o,
            "config": a.config,
            "data": a.data,
            "device": a.device,
            "updates": a.updates,
            "eval_every": a.eval_every,
            "valid_batches": a.valid_batches,
            "bleu_sentences": a.bleu_sentences,
            "beam": a.beam,
            "threads": threads,
            "bleu_steps": {int(x) for x in a.bleu_at.split(",") if x} | {a.updates},
        }  # fmt: skip
        for n, o in variants
    ]
    if a.jobs > 1:
        with mp.get_context("spawn").Pool(a.jobs) as pool:
            results = pool.map(run_variant, jobs, chunksize=1)
    else:
        results = [run_variant(j) for j in jobs]
    records = [r for rs in results for r in rs]
    if a.output:
        write_text_output(a.output, "".join(json.dumps(r) + "\n" for r in records))
    print("\nvariant              step  valid_nll  source_gain  bleu   chrf   seconds")
    for r in records:
        if "bleu" in r or r["step"] == max(
            x["step"] for x in records if x["variant"] == r["variant"]
        ):
            print(
                f"{r['variant']:<20} {r['step']:>5}  {r['valid_nll']:9.3f}  {r['source_gain']:11.3f}"
                f"  {r.get('bleu', float('nan')):5.1f}  {r.get('chrf', float('nan')):5.1f}"
                f"  {r['seconds']:7.0f}"
            )
    return 0


def main(argv: list[str] | None = None) -> int:
    """Check every variant's config before any training; bad input is one line ``error: ...``
    and exit 2."""
    return run_main(_probe, argv)


if __name__ == "__main__":
    sys.exit(main())
