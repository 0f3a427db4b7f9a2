"""The BranchNorm paper's tasks and published BLEU (Liu et al., Findings of ACL 2024, Tables 1-3),
shipped with the package so that our results can be put beside them with no file to write.

    task = TASKS["wmt17_en_de"]            # its depths, scoring, vocabulary, published table
    published("wmt17_en_de", "branchnorm", 50)   # "30.7"
    published("wmt17_en_de", "postln", 18)       # "diverged"
    published("wmt17_en_de", "branchnorm", 6)    # "29.x": the decimals are lost

Where the values come from: ../shared/paper_tables.md, from the only copy of the paper available
here, a text extraction that lost most digits after a decimal point. A lost digit is kept as
``x`` and such a cell is shown as published-but-unknown (``29.x``), never as a number; "div"
cells are shown as the paper prints them, ``diverged``. Every cell is a string as published.

Each of our residual schemes is compared with one row of a table: postln with "Post-LN"
(DeepNet's figures, cited by the paper, in Table 1), preln with "Pre-LN", deepnorm with the
paper's own re-implementation "DeepNorm (reimpl.)" (trained in the same setting as its
BranchNorm rows; DeepNet's own DeepNorm figures are in :data:`EXTRA_ROWS`), branchnorm with
"BranchNorm". Depth is N of an N-N model (a "200-layer" model of Table 3 is N = 100).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import FileShapeError, read_small_file

DIVERGED = "diverged"
"""How the paper prints a run that diverged."""


@dataclass(frozen=True)
class Task:
    """One of the paper's translation tasks: its recipe settings and its published table."""

    name: str
    title: str
    table: str
    """Where the paper publishes its BLEU ("Table 1"), or "" where it publishes none."""
    directions: tuple[str, ...]
    """Directions trained and scored (``src-tgt``); empty: every direction of the DATA_DIR."""
    depths: tuple[int, ...]
    """N of the N-N models the paper reports (and the recipe configs ``<name>_<N>L``)."""
    bleu: str
    """``tokenized`` (multi-bleu on Moses-tokenised text) or ``sacrebleu``."""
    lowercase: bool
    compound_split: bool
    scoring_note: str
    """The paper's scoring in words, and how sure we are of it."""
    vocab_size: int
    """SentencePiece vocabulary the data commands use (docs/data.md; our choice, not Table 4)."""
    rows: dict[str, dict[int, str]] = field(default_factory=dict)
    """Published BLEU per scheme (ours: postln, preln, deepnorm, branchnorm) and depth N."""
    row_names: dict[str, str] = field(default_factory=dict)
    """The paper's name of the row each scheme is compared with."""

    @property
    def scoring(self) -> str:
        """The scoring variant in a few words."""
        if self.bleu == "tokenized":
            text = "tokenized BLEU (multi-bleu style, Moses-tokenised)"
            if self.compound_split:
                text += " with compound splitting"
        else:
            text = "sacreBLEU"
        return text + (", case-insensitive" if self.lowercase else ", cased")

    def config_name(self, depth: int) -> str:
        """The shipped recipe config of depth N-N."""
        return f"{self.name}_{depth}L"


def _row(depths: tuple[int, ...], cells: str) -> dict[int, str]:
    values = cells.split()
    assert len(values) == len(depths), (depths, cells)
    return {
        d: (DIVERGED if v == "div" else v) for d, v in zip(depths, values, strict=True) if v != "-"
    }


WMT17_DEPTHS = (6, 18, 50, 100, 250)
WMT14_DEPTHS = (6, 18, 50, 100, 250, 500)
MULTI_DEPTHS = (6, 12, 24, 100, 500)  # 12, 24, 48, 200 and 1000 layers

TASKS: dict[str, Task] = {
    "wmt17_en_de": Task(
        name="wmt17_en_de",
        title="WMT17 En-De",
        table="Table 1",
        directions=("en-de",),
        depths=WMT17_DEPTHS,
        bleu="tokenized",
        lowercase=False,
        compound_split=True,
        scoring_note="multi-bleu, cased, tokenized, with compound splitting, on newstest2014 (C)",
        vocab_size=32000,
        rows={
            "postln": _row(WMT17_DEPTHS, "28.1 div div div div"),
            "preln": _row(WMT17_DEPTHS, "27.0 28.1 28.0 27.4 27.x"),
            "deepnorm": _row(WMT17_DEPTHS, "28.x 29.x 29.x 29.x 29.x"),
            "branchnorm": _row(WMT17_DEPTHS, "29.x 30.x 30.7 29.x 29.x"),
        },
        row_names={
            "postln": "Post-LN (cited)",
            "preln": "Pre-LN (cited)",
            "deepnorm": "DeepNorm (reimpl.)",
            "branchnorm": "BranchNorm",
        },
    ),
    "wmt14_en_fr": Task(
        name="wmt14_en_fr",
        title="WMT14 En-Fr",
        table="Table 2",
        directions=("en-fr",),
        depths=WMT14_DEPTHS,
        bleu="tokenized",
        lowercase=False,
        compound_split=False,
        scoring_note="multi-bleu, cased, tokenized, on newstest2014 (C)",
        vocab_size=40000,
        rows={
            "postln": _row(WMT14_DEPTHS, "41.x 43.x div div div div"),
            "preln": _row(WMT14_DEPTHS, "40.x 42.x 42.x 43.x 43.x 43.x"),
            "deepnorm": _row(WMT14_DEPTHS, "41.x 42.x 43.x 43.x 43.x 43.x"),
            "branchnorm": _row(WMT14_DEPTHS, "41.x 43.x 43.x 44.2 44.3 44.x"),
        },
        row_names={
            "postln": "Post-LN",
            "preln": "Pre-LN",
            "deepnorm": "DeepNorm (reimpl.)",
            "branchnorm": "BranchNorm",
        },
    ),
    "iwslt14_de_en": Task(
        name="iwslt14_de_en",
        title="IWSLT14 De-En",
        table="",
        directions=("de-en",),
        depths=(6, 18),
        bleu="tokenized",
        lowercase=True,
        compound_split=False,
        scoring_note="not stated by the paper (no IWSLT14 table); we use fairseq's customary "
        "tokenized, lowercased BLEU of its IWSLT14 recipe (prepare-iwslt14.sh lowercases)",
        vocab_size=10000,
    ),
    "opus100": Task(
        name="opus100",
        title="OPUS-100",
        table="Table 3",
        directions=(),
        depths=MULTI_DEPTHS,
        bleu="sacrebleu",
        lowercase=False,
        compound_split=False,
        scoring_note="sacreBLEU, cased; average BLEU of X->En and En->X (C)",
        vocab_size=64000,
        rows={
            "preln": _row(MULTI_DEPTHS, "- - - 30.x 31.x"),
            "deepnorm": _row(MULTI_DEPTHS, "- - - 31.x 32.x"),
            "branchnorm": _row(MULTI_DEPTHS, "- - - 31.4 32.3"),
        },
        row_names={
            "preln": "Pre-LN",
            "deepnorm": "DeepNorm (reimpl.)",
            "branchnorm": "BranchNorm",
        },
    ),
    "multiun": Task(
        name="multiun",
        title="MultiUN",
        table="Table 3",
        directions=(),
        depths=MULTI_DEPTHS,
        bleu="sacrebleu",
        lowercase=True,
        compound_split=False,
        scoring_note="sacreBLEU, case-insensitive; average BLEU of X->En and En->X (C)",
        vocab_size=64000,
        rows={
            "preln": _row(MULTI_DEPTHS, "- - - 52.x 53.x"),
            "deepnorm": _row(MULTI_DEPTHS, "- - - 53.x 53.x"),
            "branchnorm": _row(MULTI_DEPTHS, "- - - 53.4 54.2"),
        },
        row_names={
            "preln": "Pre-LN",
            "deepnorm": "DeepNorm (reimpl.)",
            "branchnorm": "BranchNorm",
        },
    ),
}

MULTI_TRIPLES: dict[str, dict[str, dict[int, str]]] = {
    "opus100": {
        "baseline (cited)": {
            6: "27.5 / 21.4 / 24.5",
            12: "29.5 / 22.9 / 26.2",
            24: "31.4 / 24.0 / 27.7",
        },
        "preln": {100: "34.x / 26.x / 30.x", 500: "34.x / 28.x / 31.x"},
        "deepnorm": {100: "33.x / 28.x / 31.x", 500: "34.x / 29.x / 32.x"},
        "branchnorm": {100: "34.x / 28.x / 31.4", 500: "35.x / 29.x / 32.3"},
    },
    "multiun": {
        "baseline (cited)": {6: "43.x / 52.x / 48.1", 12: "46.x / 53.x / ?"},
        "preln": {100: "49.x / 56.x / 52.x", 500: "50.x / 56.x / 53.x"},
        "deepnorm": {100: "49.x / 56.x / 53.x", 500: "50.x / 57.x / 53.x"},
        "branchnorm": {100: "49.x / 57.x / 53.4", 500: "50.x / 57.x / 54.2"},
    },
}
"""Table 3's X->En / En->X / average cells (the sweep's table shows the average)."""

EXTRA_ROWS: dict[str, dict[str, dict[int, str]]] = {
    "wmt17_en_de": {
        "DeepNorm (DeepNet's figures)": _row(WMT17_DEPTHS, "27.8 28.8 29.0 28.9 -"),
        "DS-Init (cited)": _row(WMT17_DEPTHS, "27.9 div div div div"),
        "Admin (cited)": _row(WMT17_DEPTHS, "27.9 28.8 div div div"),
        "ReZero (cited)": _row(WMT17_DEPTHS, "26.9 div div div div"),
        "R-Fixup (cited)": _row(WMT17_DEPTHS, "27.5 28.4 27.7 div div"),
        "T-Fixup (cited)": _row(WMT17_DEPTHS, "27.5 28.4 27.9 div div"),
        "DLCL (cited)": _row(WMT17_DEPTHS, "27.4 28.2 div 27.5 27.x"),
        "NormFormer (cited)": _row(WMT17_DEPTHS, "27.0 28.3 27.8 div div"),
        "Sub-LN (reimpl.)": _row(WMT17_DEPTHS, "27.x 28.x 28.x 27.x 27.x"),
    },
    "wmt14_en_fr": {
        "DLCL": _row(WMT14_DEPTHS, "41.x 42.x 43.x div div div"),
        "Sub-LN (reimpl.)": _row(WMT14_DEPTHS, "41.x 42.x 43.x 43.x 43.x 43.x"),
    },
}
"""The paper's other rows (methods this project does not implement), for reference."""


class PaperError(UserError, ValueError):
    """An unknown task or an unreadable published-figures file: a one-line message."""


def get_task(name: str) -> Task:
    """The task called ``name``; an unknown name is a PaperError listing the known ones."""
    if name not in TASKS:
        raise PaperError(f"unknown task {name!r} (known: {', '.join(TASKS)})")
    return TASKS[name]


def published(task: str, scheme: str, depth: int) -> str | None:
    """The published BLEU of ``scheme`` at N-N = ``depth`` as printed ("28.1", "29.x",
    "diverged"), or None where the paper has no such cell."""
    return get_task(task).rows.get(scheme, {}).get(int(depth))


def published_rows(task: str) -> dict[str, dict[str, str]]:
    """``{"scheme": {"depth": cell}}`` of a task (the shape of ``sweep.py table --paper FILE``)."""
    return {s: {str(d): v for d, v in row.items()} for s, row in get_task(task).rows.items()}


MAX_PUBLISHED_BYTES = 1 << 20
"""Largest published-figures file read (a table: a few KB)."""


def read_published(path: str | Path) -> dict[str, dict[str, str]]:
    """A published-figures JSON file ``{"scheme": {"depth": value}}``, values as strings."""
    try:
        data = json.loads(read_small_file(path, MAX_PUBLISHED_BYTES))
    except FileShapeError as exc:  # a FIFO, a device, a huge file: never read without bound
        raise PaperError(str(exc)) from None
    except (OSError, ValueError) as exc:
        raise PaperError(f"{path}: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise PaperError(f'{path}: expected {{"scheme": {{"depth": value}}}}')
    return {str(s): {str(d): format_cell(v) for d, v in row.items()} for s, row in data.items()}


def format_cell(value: Any) -> str:
    """A published value as printed: strings as they are ("29.x", "diverged"), numbers with
    one decimal as the paper prints them."""
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, (int, float)):
        return f"{value:.1f}"
    return DIVERGED if str(value) == "div" else str(value)


def task_of_config(name: str) -> str | None:
    """The task of a recipe config name or path (``wmt17_en_de_50L`` -> ``wmt17_en_de``)."""
    stem = Path(str(name)).name.removesuffix(".yaml")
    for task in TASKS:
        if stem.startswith(task + "_"):
            return task
    return None


MULTIUN_LANGUAGES = frozenset({"ar", "en", "es", "fr", "ru", "zh"})


def task_of_data(manifest: dict[str, Any]) -> tuple[str | None, str]:
    """(task, why) guessed from a DATA_DIR's manifest: one direction en-de, en-fr or de-en is
    WMT17 En-De, WMT14 En-Fr or IWSLT14 De-En; the six UN languages are MultiUN; any other
    multilingual English-centric corpus scores as OPUS-100. (None, why) when nothing fits."""
    directions = sorted(manifest.get("directions") or [])
    languages = set(manifest.get("languages") or [])
    for task in TASKS.values():
        if task.directions and directions == sorted(task.directions):
            return task.name, f"the DATA_DIR holds the one direction {directions[0]}"
    if languages == MULTIUN_LANGUAGES:
        return "multiun", "the DATA_DIR holds MultiUN's six languages"
    if len(directions) > 1 and manifest.get("pivot", "en") == "en":
        return "opus100", "the DATA_DIR is multilingual and English-centric"
    return None, f"no paper task has the directions {', '.join(directions) or 'none'}"
