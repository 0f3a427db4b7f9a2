"""Text in, text out: SentencePiece encoding, the target-language tag, batched beam search,
detokenisation. commands/translate.py and commands/evaluate.py are thin layers over this.

    translator = Translator.from_export("exports/run1")
    lines = translator.translate(["Guten Morgen."], src_lang="de", tgt_lang="en")

The source of a sentence is ``<2tgt> pieces... </s>`` (megatron_branchnorm.tokens), after the
same whitespace/control-character cleaning as the training data. Empty (or whitespace-only)
lines translate to empty lines without running the model, so output lines match input lines.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from megatron_branchnorm.data.text import clean
from megatron_branchnorm.errors import UserError
from megatron_branchnorm.inference.beam_search import Hypothesis, beam_search
from megatron_branchnorm.inference.export import ExportError, load_export
from megatron_branchnorm.model import EncoderDecoder
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID, lang_tag

TAG_PATTERN = re.compile(r"^<2[^<>\s]+>$")


class TranslateError(UserError, ValueError):
    """Bad input to translation (unknown language, missing tokenizer): a one-line message."""


MAX_BEAM = 1024
"""Largest --beam/--nbest: the search keeps beam x sentences decoder rows."""
MAX_LEN_A = 1e6
"""Largest --max-len-a (the limit is clamped to the model's positions anyway)."""
MAX_THREADS = 4096


@dataclass
class SearchOptions:
    """Beam search settings (defaults as docs/design.md §10: beam 4, length penalty 0.6)."""

    beam: int = 4
    """Beam size K; 1 is greedy decoding."""
    lenpen: float = 0.6
    """Length penalty: a hypothesis scores log p / length ** lenpen (fairseq)."""
    max_len_a: float = 1.2
    """Longest output: max_len_a * source length + max_len_b tokens."""
    max_len_b: int = 10
    """See max_len_a."""
    nbest: int = 1
    """Hypotheses returned per sentence."""
    batch_tokens: int = 4096
    """Most source tokens (padding included) per batch; the decoder holds beam times as many
    rows."""

    def check(self) -> None:
        """Raise TranslateError on an out-of-range setting, naming its option."""
        if not 1 <= self.beam <= MAX_BEAM:
            raise TranslateError(f"--beam must be in [1, {MAX_BEAM}], got {self.beam}")
        if not 1 <= self.nbest <= self.beam:
            raise TranslateError(
                f"--nbest must be between 1 and --beam ({self.beam}), got {self.nbest}"
            )
        if not math.isfinite(self.lenpen):
            raise TranslateError(f"--lenpen must be a finite number, got {self.lenpen}")
        if not (math.isfinite(self.max_len_a) and 0 <= self.max_len_a <= MAX_LEN_A):
            raise TranslateError(f"--max-len-a must be in [0, {MAX_LEN_A:g}], got {self.max_len_a}")
        if self.max_len_b < 0:
            raise TranslateError(f"--max-len-b must be >= 0, got {self.max_len_b}")
        if self.batch_tokens < 1:
            raise TranslateError(f"--batch-tokens must be >= 1, got {self.batch_tokens}")


def language_tags(sp: Any) -> dict[str, int]:
    """{language: id of its ``<2xx>`` tag} for every tag piece of the SentencePiece model."""
    tags = {}
    for i in range(sp.get_piece_size()):
        piece = sp.id_to_piece(i)
        if TAG_PATTERN.match(piece):
            tags[piece[2:-1]] = i
    return tags


def make_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped into batches, longest first, each with at most ``batch_tokens`` padded
    source tokens (a longer single sentence gets a batch of its own)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = lengths[current[0]] if current else lengths[i]  # longest comes first
        if current and width * (len(current) + 1) > batch_tokens:
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def pad_sources(encoded: Sequence[Sequence[int]]) -> torch.Tensor:
    """(N, longest) LongTensor of encoded sentences, padded with PAD_ID on the right."""
    src = torch.full((len(encoded), max(map(len, encoded))), PAD_ID, dtype=torch.long)
    for row, ids in enumerate(encoded):
        src[row, : len(ids)] = torch.tensor(ids)
    return src


class Translator:
    """A model with its SentencePiece model and language tags: lines in, translations out."""

    def __init__(self, model: EncoderDecoder, sp: Any, meta: dict[str, Any] | None = None) -> None:
        if sp is None:
            raise TranslateError("the export has no spm.model: cannot tokenise text")
        self.model = model.eval()
        self.sp = sp
        self.meta = meta or {}
        self.tags = language_tags(sp)
        pieces, vocab = sp.get_piece_size(), model.cfg.vocab_size
        if pieces > vocab:
            raise TranslateError(
                f"spm.model has {pieces} pieces but the model's vocab_size is only {vocab}"
            )
        # Never generated: padding, BOS, UNK, language tags, and rows past the SentencePiece
        # vocabulary (a vocab_size padded up for efficiency).
        special = {PAD_ID, BOS_ID, UNK_ID, *self.tags.values(), *range(pieces, vocab)}
        self.banned_ids = sorted(special)
        self.truncated = 0

    @classmethod
    def from_export(cls, export_dir: str | Path, device: str = "cpu") -> Translator:
        """Load ``export_dir`` (see megatron_branchnorm.inference.export)."""
        model, sp, meta = load_export(export_dir, device=device)
        if sp is None:
            raise ExportError(
                f"{Path(export_dir) / 'spm.model'}: missing (needed to tokenise text)"
            )
        return cls(model, sp, meta)

    @property
    def languages(self) -> list[str]:
        """Languages with a tag in the vocabulary."""
        return sorted(self.tags)

    def check_languages(self, src_lang: str, tgt_lang: str) -> None:
        """Raise TranslateError unless both languages have a tag in the vocabulary."""
        for flag, lang in (("--src-lang", src_lang), ("--tgt-lang", tgt_lang)):
            if lang not in self.tags:
                raise TranslateError(
                    f"{flag} {lang}: no tag {lang_tag(lang)} in the model's vocabulary "
                    f"(languages: {', '.join(self.languages) or 'none'})"
                )

    @property
    def trained_directions(self) -> list[str] | None:
        """The directions the model was trained on (export.json ``directions``, recorded by
        convert_checkpoint from the run's DATA_DIR); None when the export does not record
        them (an older export, synthetic data)."""
        dirs = self.meta.get("directions")
        if isinstance(dirs, list) and dirs and all(isinstance(d, str) for d in dirs):
            return sorted(dirs)
        return None

    def is_zero_shot(self, src_lang: str, tgt_lang: str) -> bool:
        """Whether src-tgt is a direction the model was not trained on: not among
        :attr:`trained_directions`, or (when they are not recorded) the same language on both
        sides, which no DATA_DIR trains."""
        trained = self.trained_directions
        if trained is None:
            return src_lang == tgt_lang
        return f"{src_lang}-{tgt_lang}" not in trained

    def check_direction(self, src_lang: str, tgt_lang: str, zero_shot: bool = False) -> None:
        """Raise TranslateError unless both languages have a tag and the direction was trained
        (any direction between known languages with ``zero_shot``)."""
        self.check_languages(src_lang, tgt_lang)
        if zero_shot or not self.is_zero_shot(src_lang, tgt_lang):
            return
        trained = self.trained_directions
        known = (
            f"trained: {', '.join(trained)}"
            if trained is not None
            else "no DATA_DIR trains a language into itself"
        )
        raise TranslateError(
            f"--src-lang {src_lang} --tgt-lang {tgt_lang}: the model was not trained on "
            f"{src_lang}-{tgt_lang} ({known}); --zero-shot translates it anyway"
        )

    @property
    def max_positions(self) -> int:
        """The model's position table: the longest source, and the bound of every limit."""
        return self.model.cfg.max_positions

    def encode(self, line: str, tgt_lang: str) -> list[int]:
        """``<2tgt> pieces </s>`` for one line, cut to the model's position table."""
        ids = [self.tags[tgt_lang], *self.sp.encode(clean(line)), EOS_ID]
        limit = self.max_positions
        if len(ids) > limit:
            self.truncated += 1
            ids = ids[: limit - 1] + [EOS_ID]
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """Detokenised text of generated ids."""
        return self.sp.decode(list(ids))

    def start_search(
        self,
        lines: Sequence[str],
        src_lang: str,
        tgt_lang: str,
        opts: SearchOptions | None,
        progress: Callable[[int], None] | None,
    ) -> tuple[SearchOptions, list[list[Hypothesis]], list[int]]:
        """What every engine's :meth:`translate_hypotheses` does first: the options checked,
        the direction checked, an empty result per line and the indices of the lines to
        translate (empty lines are done at once and reported to ``progress``)."""
        opts = opts or SearchOptions()
        opts.check()
        self.check_languages(src_lang, tgt_lang)
        results: list[list[Hypothesis]] = [[] for _ in lines]
        todo = [i for i, line in enumerate(lines) if clean(line)]
        if progress is not None and len(todo) < len(lines):
            progress(len(lines) - len(todo))
        return opts, results, todo

    def translate_hypotheses(
        self,
        lines: Sequence[str],
        src_lang: str,
        tgt_lang: str,
        opts: SearchOptions | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Hypothesis]]:
        """Per line its best hypotheses (empty list for an empty line), in input order.
        ``progress(n)`` is called after each batch with the number of lines done in it."""
        opts, results, todo = self.start_search(lines, src_lang, tgt_lang, opts, progress)
        encoded = [self.encode(lines[i], tgt_lang) for i in todo]
        device = next(self.model.parameters()).device
        for batch in make_batches([len(e) for e in encoded], opts.batch_tokens):
            src = pad_sources([encoded[j] for j in batch])
            hyps = beam_search(
                self.model,
                src.to(device),
                beam=opts.beam,
                lenpen=opts.lenpen,
                max_len_a=opts.max_len_a,
                max_len_b=opts.max_len_b,
                nbest=opts.nbest,
                banned_ids=self.banned_ids,
            )
            for j, h in zip(batch, hyps, strict=True):
                results[todo[j]] = h
            if progress is not None:
                progress(len(batch))
        return results

    def translate(
        self,
        lines: Sequence[str],
        src_lang: str,
        tgt_lang: str,
        opts: SearchOptions | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[str]:
        """The best translation of each line, detokenised, in input order."""
        hyps = self.translate_hypotheses(lines, src_lang, tgt_lang, opts, progress)
        return [self.decode(h[0].tokens) if h else "" for h in hyps]


def format_nbest(
    index: int, hyps: Sequence[Hypothesis], decode: Callable[[list[int]], str]
) -> list[str]:
    """``index<TAB>rank<TAB>score<TAB>text`` lines for the n-best output of one input line."""
    if not hyps:
        return [f"{index}\t0\t0.0000\t"]
    return [f"{index}\t{r}\t{h.score:.4f}\t{decode(h.tokens)}" for r, h in enumerate(hyps)]


def split_lines(data: bytes, name: str) -> list[str]:
    """UTF-8 ``data`` split on ``\\n`` only (a final newline ends the last line); invalid UTF-8
    raises TranslateError naming ``name`` and the line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line_no = data.count(b"\n", 0, exc.start) + 1
        raise TranslateError(
            f"{name}:{line_no}: invalid UTF-8 (byte 0x{data[exc.start]:02x})"
        ) from None
    if not text:
        return []
    lines = text.split("\n")
    if text.endswith("\n"):
        lines.pop()
    return lines


def read_lines(path: str | Path | None) -> list[str]:
    """The lines of a UTF-8 file, or of stdin when ``path`` is None or "-"."""
    if path is None or str(path) == "-":
        return split_lines(sys.stdin.buffer.read(), "<stdin>")
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise TranslateError(f"{path}: cannot read: {exc.strerror or exc}") from None
    return split_lines(data, str(path))


def warn(message: str) -> None:
    """A one-line warning on stderr."""
    print(f"warning: {message}", file=sys.stderr)
