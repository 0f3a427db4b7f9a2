"""The rehearsal's four checks (workflows/rehearse.py), read from a finished work directory:
(1) parity with one process, (2) SIGUSR1 + exact resume on the same topology, (3) resume on
another topology, (4) the checkpoint converts to an export that translates. Each returns
``{"name", "ok", "detail"}``; the export check also its figures."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.records import REDONE_KEY
from megatron_branchnorm.formats.records import read_metrics as read_run_metrics
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from megatron_branchnorm.training.metrics import training_rows
from megatron_branchnorm.workflows.rehearse_plan import other_micro_batches
from megatron_branchnorm.workflows.rehearse_runs import run_ok

LOSS_RTOL = 1e-4
"""S stages vs 1 stage, relative loss per step (docs/design.md §5)."""
EXPORT_RTOL = 1e-4
"""Export vs checkpoint logits, relative to their largest magnitude."""

EXACT_KEYS = ("loss", "nll_loss", "lr", "alpha", "grad_norm")
SYNTHETIC_LANGS = ("copy", "reverse")
"""Tags ``<2copy>`` and ``<2reverse>`` get ids 4 and 5: the synthetic task's task tokens."""
TRANSLATE_INPUT = "the cat sits on the mat"


def read_training_rows(save_dir: Path) -> list[dict[str, Any]]:
    """The training rows of ``save_dir/metrics.jsonl`` (no validation or skip rows)."""
    return training_rows(read_run_metrics(save_dir))


def rel_diff(a: float, b: float) -> float:
    """|a - b| / |b| (inf when either is not finite)."""
    if not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / max(abs(b), 1e-30)


def _check(name: str, ok: bool, detail: str) -> dict[str, Any]:
    return {"name": name, "ok": bool(ok), "detail": detail}


def _run_problem(runs: dict[str, Any], name: str, expect: int = 0) -> str | None:
    run = runs.get(name)
    if run is None:
        return f"run '{name}' did not run"
    if not run_ok(run, expect):
        why = f" ({run['killed']})" if run.get("killed") else ""
        return f"run '{name}' exited {run['exit_codes']}{why}, expected {expect} on every rank"
    return None


def check_parity(plan: dict, runs: dict, workdir: Path) -> dict[str, Any]:
    """(1) uninterrupted (real topology) vs reference (one process), steps 1..steps."""
    name = "(1) parity with one process"
    for r in ("uninterrupted", "reference"):
        if problem := _run_problem(runs, r):
            return _check(name, False, problem)
    real = {r["step"]: r for r in read_training_rows(workdir / "uninterrupted")}
    ref = {r["step"]: r for r in read_training_rows(workdir / "reference")}
    steps = range(1, plan["steps"] + 1)
    missing = [s for s in steps if s not in real or s not in ref]
    if missing:
        return _check(name, False, f"steps {missing} missing from metrics.jsonl")
    worst = max(max(rel_diff(real[s][k], ref[s][k]) for k in ("loss", "nll_loss")) for s in steps)
    unequal = [
        s for s in steps if real[s]["lr"] != ref[s]["lr"] or real[s]["alpha"] != ref[s]["alpha"]
    ]
    gn = max(rel_diff(real[s]["grad_norm"], ref[s]["grad_norm"]) for s in steps)
    ok = worst <= LOSS_RTOL and not unequal
    detail = (
        f"steps 1-{plan['steps']}: worst relative loss/nll difference {worst:.1e} "
        f"(tolerance {LOSS_RTOL:g}); lr and alpha "
        + ("equal" if not unequal else f"differ at steps {unequal}")
        + f"; grad norm within {gn:.1e} (not checked)"
    )
    return _check(name, ok, detail)


def _span(first: int, last: int) -> str:
    """'step 5' or 'steps 3-4'."""
    return f"step {first}" if first == last else f"steps {first}-{last}"


def _steps_once(rows: list[dict], last: int) -> str | None:
    """None when ``rows`` (read through the resumes) are steps 1..last, none of them redone
    (an exact resume repeats no update)."""
    got = [r["step"] for r in rows]
    redone = [r["step"] for r in rows if r.get(REDONE_KEY)]
    if got != list(range(1, last + 1)) or redone:
        miss = sorted(set(range(1, last + 1)) - set(got))
        return f"metrics.jsonl steps {got}: missing {miss}, repeated (redone) {redone}"
    return None


def check_resume(plan: dict, runs: dict, workdir: Path) -> dict[str, Any]:
    """(2) SIGUSR1 checkpoint, then an exact resume on the same topology."""
    name = "(2) SIGUSR1 + exact resume, same topology"
    if problem := _run_problem(runs, "uninterrupted"):
        return _check(name, False, problem)
    if problem := _run_problem(runs, "interrupted", REQUEUE_EXIT_CODE):
        return _check(name, False, problem)
    if problem := _run_problem(runs, "resumed"):
        return _check(name, False, problem)
    n = plan["steps"]
    inter = runs["interrupted"]
    saves = inter.get("saves") or []
    if not saves:
        return _check(name, False, "the interrupted run logged no checkpoint")
    stop = ckpt.tag_step(saves[-1]["tag"])
    if not 1 <= stop <= n - 2:
        return _check(
            name,
            False,
            f"the signal's checkpoint is at step {stop}: at least 2 resumed steps are needed "
            f"(restored Adam moments first show in the loss of the second): raise --steps (was {n})",
        )
    if not (workdir / "interrupted" / saves[-1]["tag"] / "checksums.json").is_file():
        return _check(name, False, f"{saves[-1]['tag']}: no checksums.json (incomplete)")
    resumed = runs["resumed"].get("resumed")
    if not resumed or resumed["step"] != stop:
        return _check(name, False, f"the resumed run did not log 'resumed from ... step {stop}'")
    rows = [r for r in read_training_rows(workdir / "interrupted") if r["step"] <= n]
    if problem := _steps_once(rows, n):
        return _check(name, False, problem)
    ref = {r["step"]: r for r in read_training_rows(workdir / "uninterrupted")}
    diffs = [
        f"step {r['step']} {k} {r[k]!r} != {ref.get(r['step'], {}).get(k)!r}"
        for r in rows
        for k in EXACT_KEYS
        if r.get(k) != ref.get(r["step"], {}).get(k)
    ]
    if diffs:
        return _check(name, False, f"{len(diffs)} difference(s): " + "; ".join(diffs[:3]))
    after = (inter.get("signal") or {}).get("after_step")
    return _check(
        name,
        True,
        f"SIGUSR1 after step {after} logged: checkpoint at step {stop}, "
        f"exit 75 on all ranks; resumed {_span(stop + 1, n)} equal the uninterrupted run's "
        f"{', '.join(EXACT_KEYS)} exactly (and the steps before the signal); metrics.jsonl "
        f"has steps 1-{n}, each once",
    )


def check_other_topology(plan: dict, runs: dict, workdir: Path) -> dict[str, Any]:
    """(3) the checkpoint continued with another stage count."""
    name = "(3) resume on another topology"
    for r in ("resumed", "other_topology", "reference"):
        if problem := _run_problem(runs, r):
            return _check(name, False, problem)
    n, more = plan["steps"], plan["other_steps"]
    other = runs["other_topology"]
    if not other.get("relayout"):
        why = other.get("layout_warning") or "no 'in another layout' line"
        return _check(name, False, f"the whole training state was not re-laid: {why}")
    resumed = other.get("resumed")
    rows = read_training_rows(workdir / "interrupted")
    if problem := _steps_once(rows, n + more):
        return _check(name, False, problem)
    ref = {r["step"]: r for r in read_training_rows(workdir / "reference")}
    first = rows[n]  # step n + 1
    if first["step"] not in ref:
        return _check(name, False, f"the reference has no step {first['step']}")
    want = ref[first["step"]]
    same_batch = plan["micro_batches"] * (plan["world"] // plan["stages"]) == (
        other_micro_batches(plan) * (plan["world"] // plan["other_stages"])
    )
    loss_diff = rel_diff(first["loss"], want["loss"])
    problems = []
    if first["lr"] != want["lr"] or first["alpha"] != want["alpha"]:
        problems.append(
            f"step {first['step']}: lr/alpha {first['lr']}/{first['alpha']} != "
            f"{want['lr']}/{want['alpha']}"
        )
    if same_batch and loss_diff > LOSS_RTOL:
        problems.append(f"step {first['step']}: loss differs by {loss_diff:.1e} from the reference")
    if resumed is not None:
        problems.append("logged a same-layout resume, expected one in another layout")
    detail = (
        f"{plan['other_stages']} stages x {plan['world'] // plan['other_stages']}: resumed the "
        f"step-{n} checkpoint with its whole state re-laid per parameter and ran "
        f"{_span(n + 1, n + more)}, every step logged "
        f"once; step {n + 1}'s lr and alpha equal the reference's, its loss within "
        f"{loss_diff:.1e}" + ("" if same_batch else " (global batch differs: loss not checked)")
    )
    return _check(name, not problems, "; ".join(problems) if problems else detail)


def checkpoint_figures(tag_dir: Path) -> dict[str, Any]:
    """Files, layer files and bytes of one checkpoint (from its checksums.json)."""
    manifest = json.loads((tag_dir / ckpt.MANIFEST).read_text(encoding="utf-8"))
    files = manifest["files"]
    layer = [f for f in files if ckpt.layer_index(f) is not None]
    return {
        "files": len(files) + 1,
        "layer_files": len(layer),
        "bytes": sum(f["bytes"] for f in files.values())
        + (tag_dir / "checksums.json").stat().st_size,
    }


def train_spm(out_dir: Path, vocab_size: int) -> Path:
    """A tiny SentencePiece model whose tags ``<2copy>``/``<2reverse>`` get ids 4 and 5 (the
    synthetic task tokens), so a synthetic run's export can translate text."""
    import random

    import sentencepiece as spm

    from megatron_branchnorm.tokens import SPM_SPECIALS, lang_tag

    out_dir.mkdir(parents=True, exist_ok=True)
    words = "the a cat dog sits runs on under mat house big small red open close file".split()
    rng = random.Random(1)
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) for _ in range(400)]
    (out_dir / "train.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(out_dir / "train.txt"),
        model_prefix=str(out_dir / "spm"),
        vocab_size=vocab_size,
        hard_vocab_limit=False,
        **SPM_SPECIALS,
        user_defined_symbols=[lang_tag(lang) for lang in SYNTHETIC_LANGS],
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return out_dir / "spm.model"


def check_export(plan: dict, runs: dict, workdir: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(4) convert the real-topology checkpoint, compare the export, translate a sentence;
    returns the check and its figures."""
    import torch

    from megatron_branchnorm.data.synthetic import SyntheticData, collate
    from megatron_branchnorm.formats.checkpoint import CheckpointError, verify_checkpoint
    from megatron_branchnorm.inference.convert import ConvertError, load_pipeline_checkpoint
    from megatron_branchnorm.inference.export import ExportError, load_export, save_export
    from megatron_branchnorm.inference.translate import SearchOptions, Translator

    name = "(4) convert + translate"
    figures: dict[str, Any] = {}
    if problem := _run_problem(runs, "resumed"):
        return _check(name, False, problem), figures
    tag = ckpt.tag_for(plan["steps"])
    save_dir = workdir / "interrupted"
    try:
        figures["checkpoint"] = checkpoint_figures(save_dir / tag)
        t = time.monotonic()
        verify_checkpoint(save_dir / tag)
        figures["verify_s"] = time.monotonic() - t
        t = time.monotonic()
        model, meta = load_pipeline_checkpoint(save_dir, tag)
        figures["load_s"] = time.monotonic() - t
        spm_path = train_spm(workdir / "spm", model.cfg.vocab_size)
        t = time.monotonic()
        out = save_export(model, workdir / "export", spm_path, meta, overwrite=True)
        figures["export_s"] = time.monotonic() - t
        figures["export_bytes"] = sum(p.stat().st_size for p in out.iterdir())
        exported, _, _ = load_export(out)
        batch = collate(SyntheticData(8, model.cfg.vocab_size, 20), list(range(8)))
        with torch.no_grad():
            want = model(batch["src_tokens"], batch["prev_output_tokens"])
            got = exported(batch["src_tokens"], batch["prev_output_tokens"])
        err = float((want - got).abs().max() / want.abs().max())
        t = time.monotonic()
        translator = Translator.from_export(out)
        hyps = translator.translate_hypotheses(
            [TRANSLATE_INPUT], SYNTHETIC_LANGS[0], SYNTHETIC_LANGS[0], SearchOptions()
        )
        figures["translate_s"] = time.monotonic() - t
    except (CheckpointError, ConvertError, ExportError, OSError, ValueError, KeyError) as exc:
        return _check(name, False, f"{type(exc).__name__}: {exc}"), figures
    text = translator.decode(hyps[0][0].tokens) if hyps[0] else ""
    figures["translation"] = text
    problems = []
    if err > EXPORT_RTOL:
        problems.append(f"export logits differ from the checkpoint's by {err:.1e}")
    if not hyps[0] or not math.isfinite(hyps[0][0].score):
        problems.append("beam search returned no hypothesis")
    n_layers = sum(plan["layers"])
    detail = (
        f"{tag}: {figures['checkpoint']['layer_files']:,} layer files ({n_layers} encoder/decoder "
        f"layers) verified and converted; export logits within {err:.1e} of the checkpoint's; "
        f"'{TRANSLATE_INPUT}' (<2copy>, beam 4) -> {text!r} ({len(hyps[0][0].tokens)} tokens; "
        "a tiny SentencePiece model stands in for the synthetic data's)"
    )
    return _check(name, not problems, "; ".join(problems) if problems else detail), figures
