"""sacreBLEU evaluation of an export on a preprocessed DATA_DIR's raw dev/test references.

    refs = references_from_manifest("data/opus100", "test")
    report = evaluate(translator, refs, lowercase=False)
    report["directions"]["de-en"]["bleu"], report["averages"]["x-en"]

References are the raw, unfiltered dev/test text that tools/preprocess_data.py keeps in
DATA_DIR (``manifest.json``: ``splits.<split>.references.<src>-<tgt>`` = ``{"src": path,
"tgt": path}``, paths relative to DATA_DIR). The BLEU tokenizer follows the target language:
``zh`` for Chinese, ``ja-mecab`` for Japanese when its dependencies are importable (else
``char``), ``13a`` otherwise. chrF is reported beside BLEU. The JSON report (docs/design.md §10):

    {"directions": {"de-en": {"bleu": 31.2, "chrf": 55.0, "signature": "nrefs:1|case:mixed|..."}},
     "averages": {"x-en": 31.2, "en-x": ..., "all": ...}}

``x-en`` averages the directions into the pivot language (English), ``en-x`` those out of
it, ``all`` every direction reported; an average with no direction is null. Zero-shot
directions, when the manifest has references for them, are translated and scored too, marked
``"zero_shot": true``, and count in ``all`` and their own ``zero-shot`` average only: those the
export's ``directions`` (the trained ones) do not list, or, when it lists none, those between
two non-pivot languages.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.data_dir import read_data_manifest
from megatron_branchnorm.formats.dirs import HYPOTHESES
from megatron_branchnorm.formats.files import one_line, read_small_file
from megatron_branchnorm.formats.outputs import (
    check_output_file,
    prepare_side_dir,
    write_text_output,
)
from megatron_branchnorm.inference.translate import SearchOptions, Translator, split_lines


class EvaluationError(UserError, ValueError):
    """Bad evaluation input (manifest, references, directions): a one-line message."""


@dataclass
class DirectionData:
    """One direction's source and reference files."""

    src_lang: str
    tgt_lang: str
    src_path: Path
    ref_path: Path

    @property
    def name(self) -> str:
        return f"{self.src_lang}-{self.tgt_lang}"


def references_from_manifest(data_dir: str | Path, split: str) -> dict[str, DirectionData]:
    """{"de-en": DirectionData, ...} for every direction with references in ``split``.

    Reads ``manifest["splits"][split]["references"]`` (each entry ``{"src": path, "tgt":
    path}``, relative to DATA_DIR) through the manifest's one reader
    (:meth:`megatron_branchnorm.formats.data_dir.DataManifest.references`); missing files are
    errors naming them.
    """
    refs = read_data_manifest(data_dir).references(split)
    return {name: DirectionData(r.src_lang, r.tgt_lang, r.src, r.tgt) for name, r in refs.items()}


def pivot_language(data_dir: str | Path) -> str:
    """The pivot language of a DATA_DIR (manifest ``pivot``; English when not recorded)."""
    return read_data_manifest(data_dir).pivot


@cache
def _ja_mecab_available() -> bool:
    try:
        BLEU(tokenize="ja-mecab")
    except Exception:  # noqa: BLE001 - sacreBLEU raises RuntimeError/ImportError variants
        return False
    return True


def bleu_tokenizer(tgt_lang: str) -> str:
    """sacreBLEU tokenizer for a target language: zh, ja-mecab (or char), else 13a."""
    base = tgt_lang.lower().split("_")[0].split("-")[0]
    if base == "zh":
        return "zh"
    if base == "ja":
        return "ja-mecab" if _ja_mecab_available() else "char"
    return "13a"


SACREBLEU_TOKENIZERS = ("13a", "intl", "zh", "ja-mecab", "char", "flores101", "flores200", "none")
"""Tokenizers ``--tokenize`` may name; one whose dependencies are missing is refused."""
COMPOUND_SPLIT = re.compile(r"(\S)-(\S)")
"""``a-b`` -> ``a ##AT##-##AT## b``: the compound splitting customary for En-De tokenized BLEU
(as in tensor2tensor's and fairseq's ``get_ende_bleu.sh`` / ``compound_split_bleu.sh``)."""


@dataclass(frozen=True)
class Scoring:
    """How BLEU is computed (chrF always on the detokenised text).

    ``sacrebleu`` (default): sacreBLEU on detokenised text with ``tokenize`` (None: by target
    language, :func:`bleu_tokenizer`). ``tokenized``: the multi-bleu style of the WMT14 En-Fr
    and WMT17 En-De papers: hypotheses and references Moses-tokenised (sacremoses, the target
    language's rules), optionally with compound splitting, then BLEU on whitespace tokens.
    """

    bleu: str = "sacrebleu"
    tokenize: str | None = None
    lowercase: bool = False
    compound_split: bool = False

    @classmethod
    def from_args(cls, args) -> Scoring:
        """From the flags :func:`add_scoring_args` adds (sacreBLEU when --bleu is not given)."""
        return cls(args.bleu or "sacrebleu", args.tokenize, args.lowercase, args.compound_split)

    @classmethod
    def for_task(cls, task: str) -> Scoring:
        """The paper's scoring of one of its tasks (megatron_branchnorm/paper.py)."""
        from megatron_branchnorm.paper import get_task

        t = get_task(task)
        return cls(t.bleu, None, t.lowercase, t.compound_split)

    def check(self) -> None:
        """A one-line EvaluationError for an unknown or unavailable choice."""
        if self.bleu not in ("sacrebleu", "tokenized"):
            raise EvaluationError(f"--bleu: unknown {self.bleu!r} (sacrebleu or tokenized)")
        if self.bleu == "tokenized" and self.tokenize is not None:
            raise EvaluationError("--tokenize applies to --bleu sacrebleu only")
        if self.compound_split and self.bleu != "tokenized":
            raise EvaluationError("--compound-split applies to --bleu tokenized only")
        if self.tokenize is not None:
            if self.tokenize not in SACREBLEU_TOKENIZERS:
                known = ", ".join(SACREBLEU_TOKENIZERS)
                raise EvaluationError(f"--tokenize: unknown {self.tokenize!r} ({known})")
            try:
                BLEU(tokenize=self.tokenize)
            except Exception as exc:  # noqa: BLE001 - a missing optional dependency
                raise EvaluationError(
                    f"--tokenize {self.tokenize}: not available here ({one_line(str(exc), 200)})"
                ) from None


def scoring_flags_given(args) -> bool:
    """Whether any flag of :func:`add_scoring_args` that chooses the BLEU was given."""
    return bool(args.bleu or args.tokenize or args.lowercase or args.compound_split)


def _held_out(manifest: Any, split: str, direction: str) -> bool:
    """Whether the manifest says ``split`` of ``direction``'s pair was held out of the
    training lines (``splits.<split>.pairs.<pair>.source``) rather than read from files."""
    pair = "-".join(sorted(direction.split("-")))
    entry: Any = manifest
    for key in ("splits", split, "pairs", pair, "source"):
        entry = entry.get(key) if isinstance(entry, Mapping) else None
    return entry == "held-out"


def choose_scoring(
    args, data_dir: str | Path, split: str = "test"
) -> tuple[Scoring, dict[str, Any]]:
    """(scoring, how it was chosen) for evaluate.py: the flags when any is given; else the
    paper's variant for ``--task``, or for the task the DATA_DIR looks like (``--task auto``,
    the default: megatron_branchnorm.paper.task_of_data); else cased sacreBLEU.

    ``how["task_directions"]`` lists the directions the scoring is for (a task's own; empty:
    every direction): evaluate scores any other direction with the default cased sacreBLEU.
    ``--task auto`` takes a one-direction task (WMT, IWSLT) only when the DATA_DIR's ``split``
    of that direction came from files: a split held out of the training lines is not the
    task's test set, so it gets the default scoring and ``chosen_by`` says why."""
    from megatron_branchnorm.paper import PaperError, get_task, task_of_data

    if scoring_flags_given(args):
        how = {"task": None, "chosen_by": "the scoring flags given", "task_directions": []}
        return Scoring.from_args(args), how
    task, why = args.task, "--task"
    if task == "auto":
        manifest = read_data_manifest(data_dir).raw
        task, why = task_of_data(manifest)
        held = (
            [d for d in get_task(task).directions if _held_out(manifest, split, d)] if task else []
        )
        if held:
            title = get_task(task).title
            why = (
                f"{held[0]} looks like {title}, but its {split} set was held out of the training "
                f"lines, so it is not {title}'s; --task {task} scores it that way anyway"
            )
            task = None
    if task in (None, "none"):
        return Scoring(), {"task": None, "chosen_by": f"default ({why})", "task_directions": []}
    try:
        t = get_task(task)
    except PaperError as exc:
        raise EvaluationError(f"--task: {exc}") from None
    return Scoring.for_task(task), {
        "task": task,
        "chosen_by": f"the paper's for {t.title} ({why}): {t.scoring}",
        "task_directions": list(t.directions),
    }


def describe_scoring(
    how: dict[str, Any],
    scoring: Scoring,
    directions: Sequence[DirectionData],
    split: str,
    data_dir: str | Path,
) -> dict[str, Any]:
    """The report's ``scoring``: how it was chosen, the chosen :class:`Scoring`, what was
    scored (``scored``: the split and DATA_DIR), the directions it ``applies_to`` and those
    scored with the default cased sacreBLEU instead (``default_for``, with a ``note``)."""
    wanted = how.get("task_directions") or []
    names = [d.name for d in directions]
    applies = [n for n in names if not wanted or n in wanted]
    others = [n for n in names if n not in applies]
    out = {**how, **dataclasses.asdict(scoring), "scored": f"the {split} split of {data_dir}"}
    out.update({"applies_to": applies, "default_for": others})
    if others:
        from megatron_branchnorm.paper import get_task

        title = get_task(how["task"]).title
        out["note"] = (
            f"{', '.join(others)}: default cased sacreBLEU ({title}'s scoring is for "
            f"{', '.join(wanted)} only)"
        )
    return out


def add_scoring_args(p) -> None:
    """The flags that choose how BLEU is computed (:class:`Scoring`)."""
    p.add_argument("--lowercase", action="store_true", help="case-insensitive BLEU and chrF")
    p.add_argument(
        "--bleu",
        choices=("sacrebleu", "tokenized"),
        default=None,
        help="sacrebleu: on detokenised text (OPUS-100, MultiUN); tokenized: Moses-tokenised "
        "hypotheses and references, multi-bleu style (WMT14 En-Fr, WMT17 En-De); "
        "default: sacrebleu, or in evaluate.py the paper's variant for --task",
    )
    p.add_argument(
        "--tokenize",
        default=None,
        help="sacreBLEU's tokenizer: 13a, intl, zh, ja-mecab, char, flores200, ... "
        "(default: by target language)",
    )
    p.add_argument(
        "--compound-split",
        action="store_true",
        help="with --bleu tokenized: a-b -> a ##AT##-##AT## b (customary for En-De)",
    )


@cache
def _moses(lang: str):
    from sacremoses import MosesTokenizer

    return MosesTokenizer(lang=lang)


def moses_tokenize(lines: Sequence[str], lang: str, compound_split: bool = False) -> list[str]:
    """Moses-tokenised lines (no HTML escaping), with ``a ##AT##-##AT## b`` compounds."""
    tok = _moses(lang)
    out = [tok.tokenize(line, return_str=True, escape=False) for line in lines]
    return [COMPOUND_SPLIT.sub(r"\1 ##AT##-##AT## \2", x) for x in out] if compound_split else out


def score_direction(
    hypotheses: Sequence[str],
    references: Sequence[str],
    tgt_lang: str,
    lowercase: bool = False,
    scoring: Scoring | None = None,
) -> dict[str, Any]:
    """{"bleu", "chrf", "signature"} of one direction (corpus-level, one reference)."""
    scoring = scoring or Scoring(lowercase=lowercase)
    if len(hypotheses) != len(references):
        raise EvaluationError(
            f"{len(hypotheses)} hypotheses for {len(references)} references ({tgt_lang})"
        )
    hyps, refs = list(hypotheses), list(references)
    c = CHRF(lowercase=scoring.lowercase).corpus_score(hyps, [refs])
    if scoring.bleu == "tokenized":
        split = scoring.compound_split
        hyps = moses_tokenize(hyps, tgt_lang, split)
        refs = moses_tokenize(refs, tgt_lang, split)
        bleu = BLEU(tokenize="none", lowercase=scoring.lowercase, force=True)
        prefix = f"moses-tok:{tgt_lang}|compound-split:{'yes' if split else 'no'}|"
    else:
        bleu = BLEU(
            tokenize=scoring.tokenize or bleu_tokenizer(tgt_lang), lowercase=scoring.lowercase
        )
        prefix = ""
    b = bleu.corpus_score(hyps, [refs])
    return {
        "bleu": round(float(b.score), 4),
        "chrf": round(float(c.score), 4),
        "signature": prefix + str(bleu.get_signature()),
    }


def averages(
    directions: dict[str, dict[str, Any]], pivot: str = "en", zero_shot: Sequence[str] | None = None
) -> dict[str, float | None]:
    """BLEU averages over x->pivot, pivot->x, all (and zero-shot when there is any).

    ``zero_shot`` names the directions the model was not trained on (None: not recorded, then
    those between two non-pivot languages); they count in ``all`` and ``zero-shot`` only."""

    def mean(names: list[str]) -> float | None:
        if not names:
            return None
        return round(sum(directions[n]["bleu"] for n in names) / len(names), 4)

    pairs = {n: n.split("-") for n in directions}
    if zero_shot is None:
        zero_shot = [n for n, (s, t) in pairs.items() if pivot not in (s, t)]
    trained = {n: st for n, st in pairs.items() if n not in zero_shot}
    out = {
        "x-en": mean([n for n, (s, t) in trained.items() if t == pivot and s != pivot]),
        "en-x": mean([n for n, (s, t) in trained.items() if s == pivot and t != pivot]),
        "all": mean(list(directions)),
    }
    zero = [n for n in directions if n in zero_shot]
    if zero:
        out["zero-shot"] = mean(zero)
    return out


def read_lines(path: Path) -> list[str]:
    """The lines of a source, reference or hypothesis file (split as :func:`split_lines`); an
    unreadable file is an :class:`EvaluationError` naming it."""
    try:
        return split_lines(path.read_bytes(), str(path))
    except OSError as exc:
        raise EvaluationError(f"{path}: cannot read: {exc.strerror or exc}") from None


def hypothesis_path(hyp_dir: str | Path, d: DirectionData) -> Path:
    """Where ``--hyp-dir`` receives direction ``d``'s hypotheses."""
    return Path(hyp_dir) / f"{d.name}.txt"


REPORT_KEYS = frozenset({"directions", "averages", "scoring", "engine"})
"""The keys of an evaluate --json report (``scoring`` since the paper's scoring, ``engine``
since CTranslate2 exports): how one of ours is recognised, so that a rerun may replace it and
nothing else."""
MAX_REPORT_BYTES = 16 << 20
HYP_NAME = re.compile(r"^[^-./]+-[^-./]+\.txt$")
"""A file name :func:`hypothesis_path` gives (``<src>-<tgt>.txt``)."""


def is_evaluation_report(path: str | Path) -> bool:
    """Whether ``path`` is an evaluate --json report of ours: a JSON object with
    ``directions`` and ``averages`` (and ``scoring``) and no other key, every direction an
    object with a ``bleu``."""
    try:
        data = json.loads(read_small_file(path, MAX_REPORT_BYTES))
    except (OSError, ValueError):  # FileShapeError too: a device or FIFO is not ours
        return False
    if not isinstance(data, dict) or not {"directions", "averages"} <= set(data) <= REPORT_KEYS:
        return False
    found = data["directions"]
    return isinstance(found, dict) and all(
        isinstance(r, dict) and "bleu" in r for r in found.values()
    )


def is_older_hyp_dir(path: Path) -> bool:
    """Whether the directory ``path`` holds only hypothesis files (``<src>-<tgt>.txt``): an
    --hyp-dir written before it carried a marker (replaced only with --overwrite)."""
    return all(HYP_NAME.match(p.name) and p.is_file() for p in path.iterdir())


def check_outputs(
    json_path: str | Path | None,
    hyp_dir: str | Path | None,
    directions: Sequence[DirectionData],
    data_dir: str | Path,
    model_dir: str | Path,
    overwrite: bool = False,
) -> bool:
    """Refuse, before anything is translated, a --json or --hyp-dir that is, contains or lies
    inside --data, --model or a reference file, or lies inside a directory of a known kind (a
    run, a checkpoint, a DATA_DIR, an export: formats/dirs.py); a --json that is a directory,
    one of the hypothesis files, or an existing file that is not a report of ours (unless
    ``overwrite``); a --hyp-dir that is a file, lies under one, or is a non-empty directory
    not marked as ours (:func:`outputs.prepare_side_dir`). Returns whether an existing
    --hyp-dir will be replaced."""
    inputs: list[tuple[str, str | Path | None]] = [("--data", data_dir), ("--model", model_dir)]
    for d in directions:
        inputs.append((f"--data ({d.name} source)", d.src_path))
        inputs.append((f"--data ({d.name} reference)", d.ref_path))
    hyp_files: list[tuple[str, str | Path | None]] = []
    replace = False
    if hyp_dir is not None:
        replace = prepare_side_dir(
            hyp_dir, HYPOTHESES.name, "--hyp-dir", inputs, overwrite, is_older_hyp_dir
        )
        hyp_files = [("--hyp-dir", hyp_dir)]
    if json_path is not None:
        check_output_file(
            json_path,
            "--json",
            inputs + hyp_files,
            is_evaluation_report,
            "a report of evaluate --json",
            overwrite,
        )
    return replace


def select_directions(
    available: dict[str, DirectionData], wanted: Sequence[str] | None
) -> list[DirectionData]:
    """The directions to evaluate: all, or the ``wanted`` ones (each must exist)."""
    if not wanted:
        return list(available.values())
    missing = [w for w in wanted if w not in available]
    if missing:
        raise EvaluationError(
            f"--directions {','.join(missing)}: no references (available: {', '.join(available)})"
        )
    return [available[w] for w in wanted]


def evaluate(
    translator: Translator,
    directions: Sequence[DirectionData],
    opts: SearchOptions | None = None,
    lowercase: bool = False,
    hyp_dir: str | Path | None = None,
    max_sentences: int | None = None,
    pivot: str = "en",
    progress: Callable[[str, int], Callable[[int], None] | None] | None = None,
    scoring: Scoring | None = None,
    scoring_directions: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Translate and score every direction; returns the JSON report (module docstring).

    ``scoring`` applies to ``scoring_directions`` (None: to all); any other direction is scored
    with the default cased sacreBLEU. A zero-shot direction (module docstring) is translated
    all the same and marked ``"zero_shot": true``. ``hyp_dir`` receives the detokenised
    hypotheses as ``<src>-<tgt>.txt``. ``progress(name, total)`` may return a per-batch
    callback (e.g. a tqdm bar's update).
    """
    results: dict[str, dict[str, Any]] = {}
    zero_shot: list[str] = []
    if hyp_dir is not None:
        Path(hyp_dir).mkdir(parents=True, exist_ok=True)
    for d in directions:
        sources, refs = read_lines(d.src_path), read_lines(d.ref_path)
        if not sources:
            raise EvaluationError(f"{d.src_path}: empty (no sentence to score for {d.name})")
        if len(sources) != len(refs):
            raise EvaluationError(
                f"{d.src_path} has {len(sources)} lines but {d.ref_path} has {len(refs)}"
            )
        if max_sentences is not None:
            sources, refs = sources[:max_sentences], refs[:max_sentences]
        callback = progress(d.name, len(sources)) if progress is not None else None
        hyps = translator.translate(sources, d.src_lang, d.tgt_lang, opts, callback)
        if hyp_dir is not None:
            write_text_output(hypothesis_path(hyp_dir, d), "".join(h + "\n" for h in hyps))
        applies = scoring_directions is None or d.name in scoring_directions
        results[d.name] = score_direction(
            hyps, refs, d.tgt_lang, lowercase, scoring if applies else Scoring()
        )
        if _zero_shot(translator, d, pivot):
            results[d.name]["zero_shot"] = True
            zero_shot.append(d.name)
    return {"directions": results, "averages": averages(results, pivot, zero_shot)}


def _zero_shot(translator: Translator, d: DirectionData, pivot: str) -> bool:
    """Whether ``d`` is zero-shot: not trained (export.json ``directions``), or, where those
    are not recorded, not into or out of the pivot, or a language into itself."""
    if translator.trained_directions is not None:
        return translator.is_zero_shot(d.src_lang, d.tgt_lang)
    return pivot not in (d.src_lang, d.tgt_lang) or d.src_lang == d.tgt_lang


def format_table(report: dict[str, Any]) -> str:
    """A plain-text table of a report: one row per direction, then the averages."""
    rows = []
    if "scoring" in report:
        how = report["scoring"]
        rows.append(f"scoring: {how['chosen_by']}")
        if "scored" in how:
            rows.append(f"scored: {how['scored']}: {', '.join(how['applies_to']) or 'nothing'}")
        if how.get("note"):
            rows.append(f"scored: {how['note']}")
    rows.append(f"{'direction':<12} {'BLEU':>7} {'chrF':>7}  tokenizer")
    for name, r in report["directions"].items():
        parts = dict(p.split(":", 1) for p in r["signature"].split("|") if ":" in p)
        tok = parts.get("tok", "?")
        if "moses-tok" in parts:  # --bleu tokenized
            tok = "moses" + (" + compound split" if parts.get("compound-split") == "yes" else "")
        zero = " (zero-shot: not trained)" if r.get("zero_shot") else ""
        rows.append(f"{name:<12} {r['bleu']:>7.2f} {r['chrf']:>7.2f}  {tok}{zero}")
    rows.append("-" * 38)
    for name, value in report["averages"].items():
        shown = "-" if value is None else f"{value:.2f}"
        rows.append(f"{'avg ' + name:<12} {shown:>7}")
    sigs = sorted({r["signature"] for r in report["directions"].values()})
    rows += [f"signature: {s}" for s in sigs]
    return "\n".join(rows)
