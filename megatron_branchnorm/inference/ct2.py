"""CTranslate2 export and translation: the same translations as our beam search, faster on CPU.

    export_ct2(model, "exports/run1-ct2", "data/spm.model", meta, quantization="int8")
    translator = CT2Translator.from_export("exports/run1-ct2")
    lines = translator.translate(["Guten Morgen."], src_lang="de", tgt_lang="en")

The export directory (formats/dirs.py ``ct2_export``) holds what ctranslate2's converter writes
from our Hugging Face export (inference/hf_export.py, made in a temporary directory and checked
against our logits there): ``model.bin``, ``config.json``, ``shared_vocabulary.json``; beside
them our ``spm.model`` and ``export.json`` (the native export's provenance: directions,
vocabulary hash, languages, step, scheme; plus the engine, the quantization and the position
table size). It is written in a temporary directory and renamed whole.

ctranslate2's Marian loader assumes a Marian-trained model (the decoder starts from a zero
embedding, a trailing ``<pad>`` row is dropped); ours starts from the BOS embedding and keeps
every row, so :func:`export_ct2` gives the converter a loader with the BART rules for those
two points (the rest is the Marian loader, unchanged).

Search settings map one to one (:meth:`CT2Translator.translate_hypotheses`), ours (SearchOptions)
on the left, ``ctranslate2.Translator.translate_batch``'s on the right:

| ours | CTranslate2 |
| --- | --- |
| ``beam`` | ``beam_size`` |
| ``lenpen``: sum log p (EOS in) / (tokens + 1) ** lenpen | ``length_penalty``: the same |
| ``max_len_a/b``: at most L = a * src_len + b tokens | ``max_decoding_length`` L + 1, cut to L |
| ``batch_tokens`` | ``max_batch_size``, ``batch_type="tokens"`` |
| ``nbest`` | ``num_hypotheses`` |
| banned ids (pad, BOS, tags, padded rows; UNK) | ``suppress_sequences``; ``disable_unk`` |
| ``<2tgt>`` first in the source | the same (as ``>>tgt<<``); no ``target_prefix`` |

The length penalty is fairseq's in both (not GNMT's ((5 + n) / 6) ** lenpen):
tests/inference/test_ct2.py checks CTranslate2's scores against it. CTranslate2 counts the EOS
in ``max_decoding_length``, hence L + 1; it takes one limit per call, so sentences of
neighbouring limits share a call at the largest (:data:`MIN_CALL`) and each output is cut to
its own L. The decoder starts from
BOS in both: the target-language tag is on the source side, so no ``target_prefix``.

Two differences remain. Banned tokens: ours sets their log-probabilities to -inf after the
softmax, CTranslate2 masks them before it (the others' probabilities are renormalised), so
scores differ by the banned mass, which a trained model keeps tiny. At the length limit ours
forces EOS and scores it; CTranslate2 stops without it, or goes on to its call's limit. A
sentence whose search is still running at its limit may therefore get another hypothesis
(cut to its limit); others agree up to floating-point ties.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.files import (
    file_inside,
    one_line,
    quote,
    read_json_object,
    sha256_file,
)
from megatron_branchnorm.formats.outputs import (
    OutputError,
    json_has_format,
    prepare_output,
    publish_dir,
    temp_dir_beside,
    write_marker,
)
from megatron_branchnorm.inference.beam_search import Hypothesis
from megatron_branchnorm.inference.export import EXPORT_TOOL, SPM, ExportError, write_failure
from megatron_branchnorm.inference.translate import (
    SearchOptions,
    Translator,
    language_tags,
)
from megatron_branchnorm.tokens import BOS_ID, PAD_ID, UNK_ID

CT2_EXPORT_KIND = dirs.CT2_EXPORT.name
"""Marker kind of a CTranslate2 export directory (formats/dirs.py owns its layout)."""
CT2_FORMAT = "megatron_branchnorm-ct2-export"
"""``format`` of a CTranslate2 export's export.json."""
CT2_VERSION = 1
CT2_MODEL = "model.bin"
CT2_VOCABULARY = "shared_vocabulary.json"
META = dirs.EXPORT_META
ENGINE = "ctranslate2"
PYTORCH_ENGINE = "pytorch"
QUANTIZATIONS = ("int8", "int8_float32", "int16", "float16", "float32")
"""``--quantization`` values: the weight types ctranslate2's converter writes that a CPU or a
GPU can load (CPUs run float16 weights as float32)."""
DEFAULT_QUANTIZATION = "float32"
"""The default keeps the model's function exactly (the same translations as our beam search);
int8 is a choice a user makes knowing it costs a little BLEU."""
COMPUTE_TYPES = ("default", "auto", "int8", "int8_float32", "int16", "float16", "float32")
"""``--compute-type`` values (ctranslate2.Translator's ``compute_type``; default: the
export's quantization, or the nearest type the device runs)."""
MAX_META_BYTES = 1 << 20
_OWN_KEYS = frozenset({"format", "version", "sha256"})
"""export.json keys a CTranslate2 export writes itself (a native export's meta has its own)."""
INSTALL_HINT = "pip install ctranslate2 (or pip install -e .[ct2])"


class CT2Error(UserError, ValueError):
    """A CTranslate2 export or translation problem: one line naming the file or option."""


def require_ctranslate2(what: str) -> Any:
    """The ctranslate2 module; CT2Error saying how to install it when it is missing."""
    try:
        import ctranslate2
    except ImportError:
        raise CT2Error(f"{what} needs ctranslate2: {INSTALL_HINT}") from None
    return ctranslate2


def is_ct2_export(path: str | Path) -> bool:
    """Whether ``path`` is a CTranslate2 export directory (its export.json says so, or it
    holds ctranslate2's model.bin): translate.py and evaluate.py pick the engine by it."""
    path = Path(path)
    if not path.is_dir():
        return False
    return json_has_format(path / META, CT2_FORMAT, MAX_META_BYTES) or (path / CT2_MODEL).is_file()


def engine_label(translator: Translator) -> str:
    """``pytorch`` or ``ctranslate2 <compute type>``: which engine translates (reports)."""
    return translator.engine if isinstance(translator, CT2Translator) else PYTORCH_ENGINE


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------


def _converter_class(ctranslate2: Any) -> type:
    """ctranslate2's TransformersConverter with a Marian loader for our conventions."""
    import transformers
    from ctranslate2.converters.transformers import (
        BartLoader,
        MarianMTLoader,
        TransformersConverter,
    )

    class OurMarianLoader(MarianMTLoader):
        """Marian, but the decoder starts from the BOS embedding and every row is kept."""

        def get_model_spec(self, model: Any) -> Any:
            model.config.normalize_before = False
            model.config.normalize_embedding = False
            return BartLoader.get_model_spec(self, model)  # no pad row removed

        def set_config(self, config: Any, model: Any, tokenizer: Any) -> None:
            BartLoader.set_config(self, config, model, tokenizer)  # decoder starts at BOS
            config.bos_token = tokenizer.convert_ids_to_tokens(model.config.bos_token_id)

        def set_decoder(self, spec: Any, decoder: Any) -> None:
            BartLoader.set_decoder(self, spec, decoder)  # the BOS embedding, not zeros

        def get_vocabulary(self, model: Any, tokenizer: Any) -> list[str]:
            tokens = BartLoader.get_vocabulary(self, model, tokenizer)
            # rows past the SentencePiece pieces (a padded vocab_size): never generated
            extra = model.config.vocab_size - len(tokens)
            return tokens + [f"<unused-row-{i}>" for i in range(extra)]

    class OurConverter(TransformersConverter):
        def _load(self) -> Any:
            path = self._model_name_or_path
            model = transformers.MarianMTModel.from_pretrained(path)
            tokenizer = transformers.MarianTokenizer.from_pretrained(path)
            return OurMarianLoader()(model, tokenizer)

    return OurConverter


def export_ct2(
    model: Any,
    out_dir: str | Path,
    spm_model_path: str | Path | None,
    meta: dict[str, Any] | None = None,
    quantization: str = DEFAULT_QUANTIZATION,
    overwrite: bool = False,
    output_flag: str = "--output",
    inputs: Sequence[tuple[str, str | Path | None]] = (),
) -> dict[str, Any]:
    """Write a CTranslate2 export of ``model`` (an EncoderDecoder of a scheme that folds to
    Post-LN) with its SentencePiece model and ``meta`` (export.json provenance, as
    convert_checkpoint records it); returns ``{"max_abs_diff": ...}`` of the Hugging Face
    export it was converted from. ``out_dir`` follows the output rules of every export
    (absent, empty, or with ``overwrite`` a CTranslate2 export; never over an input)."""
    from megatron_branchnorm.inference.export import _residual_alpha
    from megatron_branchnorm.inference.hf_export import export_hf
    from megatron_branchnorm.model.residual import scheme_of

    out_dir = Path(out_dir)
    inputs = [*inputs, ("the SentencePiece model", spm_model_path)]
    _prepare(out_dir, overwrite, output_flag, inputs)
    if quantization not in QUANTIZATIONS:
        raise CT2Error(f"--quantization {quantization}: one of {', '.join(QUANTIZATIONS)}")
    ctranslate2 = require_ctranslate2("--format ctranslate2")
    if spm_model_path is None:
        raise CT2Error(
            "--format ctranslate2: the checkpoint has no SentencePiece model (CTranslate2 "
            "translates tokens: the export needs the vocabulary)"
        )
    scheme = scheme_of(model.cfg)
    if not scheme.marian_exportable:  # refused before any work, as --format hf refuses it
        raise CT2Error(
            f"--format ctranslate2: a {scheme.label} model has no CTranslate2 equivalent (it "
            f"is converted through a Marian model: {scheme.hf_refusal}); export it with "
            "--format native"
        )
    try:
        tmp = temp_dir_beside(out_dir, EXPORT_TOOL)
    except OSError as exc:
        raise write_failure(exc, out_dir, "CTranslate2 export") from None
    try:
        hf = export_hf(model, tmp / ".hf", spm_model_path)  # checked against our logits
        _converter_class(ctranslate2)(str(tmp / ".hf")).convert(
            str(tmp / ".ct2"), quantization=quantization
        )
        for path in (tmp / ".ct2").iterdir():
            path.rename(tmp / path.name)
        shutil.rmtree(tmp / ".ct2")
        shutil.rmtree(tmp / ".hf")
        shutil.copyfile(spm_model_path, tmp / SPM)
        c = model.cfg
        info: dict[str, Any] = {"format": CT2_FORMAT, "version": CT2_VERSION}
        info.update({k: v for k, v in (meta or {}).items() if k not in _OWN_KEYS})
        info.update(
            {
                "engine": ENGINE,
                "ctranslate2_version": ctranslate2.__version__,
                "quantization": quantization,
                "step": int(model.step),
                "alpha": _residual_alpha(model),
                "scheme": scheme.name,
                "residual": "postln",
                "model": f"{c.encoder_layers}L-{c.decoder_layers}L d={c.hidden_size}",
                "max_positions": c.max_positions,
                "vocab_size": c.vocab_size,
                "sha256": {
                    name: sha256_file(tmp / name)
                    for name in sorted(p.name for p in tmp.iterdir())
                    if dirs.CT2_EXPORT.owns(name) and name != dirs.MARKER
                },
            }
        )
        with open(tmp / META, "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, ensure_ascii=False)
            f.write("\n")
        write_marker(tmp, EXPORT_TOOL, CT2_EXPORT_KIND)
        _prepare(out_dir, overwrite, output_flag, inputs)  # still ours to replace
        publish_dir(tmp, out_dir)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        raise write_failure(exc, out_dir, "CTranslate2 export") from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {"max_abs_diff": hf["max_abs_diff"], "quantization": quantization}


def _prepare(out_dir: Path, overwrite: bool, flag: str, inputs: list) -> None:
    try:
        prepare_output(out_dir, CT2_EXPORT_KIND, overwrite, flag, inputs)
    except OutputError as exc:
        raise ExportError(str(exc)) from None


# --------------------------------------------------------------------------------------------
# Translation
# --------------------------------------------------------------------------------------------


def read_ct2_meta(export_dir: Path) -> dict[str, Any]:
    """export.json of a CTranslate2 export, its format, checksums and sizes checked."""
    path = export_dir / META
    meta = read_json_object(path, CT2Error, "missing (not a CTranslate2 export of ours?)")
    if meta.get("format") != CT2_FORMAT:
        raise CT2Error(f"{path}: not a {CT2_FORMAT} file (export it with --format ctranslate2)")
    if meta.get("version") != CT2_VERSION:
        raise CT2Error(f"{path}: unsupported version {quote(meta.get('version'))}")
    for key in ("max_positions", "vocab_size"):
        value = meta.get(key)
        if not isinstance(value, int) or isinstance(value, bool) or value < 2:
            raise CT2Error(f"{path}: key {key} must be an integer >= 2, got {quote(value)}")
    sums = meta.get("sha256")
    if not isinstance(sums, dict) or not all(isinstance(v, str) for v in sums.values()):
        raise CT2Error(f"{path}: key sha256 must be an object of file name: hex digest")
    for name, expected in sums.items():
        file = file_inside(export_dir, name, path, "sha256", CT2Error)
        if sha256_file(file) != expected:
            raise CT2Error(f"{file}: checksum mismatch (corrupt or modified file)")
    return meta


class CT2Translator(Translator):
    """A CTranslate2 export with its SentencePiece model: the text handling of
    :class:`Translator` (tags, directions, cleaning, detokenisation), CTranslate2's search."""

    def __init__(
        self, export_dir: str | Path, compute_type: str = "default", threads: int = 0
    ) -> None:
        ctranslate2 = require_ctranslate2("a CTranslate2 export")
        import sentencepiece as spm

        export_dir = Path(export_dir)
        self.meta = read_ct2_meta(export_dir)
        vocab_path = file_inside(export_dir, CT2_VOCABULARY, export_dir, None, CT2Error)
        try:
            self.vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise CT2Error(f"{vocab_path}: cannot read ({one_line(str(exc), 200)})") from None
        if not isinstance(self.vocab, list) or len(self.vocab) != self.meta["vocab_size"]:
            raise CT2Error(f"{vocab_path}: not a list of {self.meta['vocab_size']} tokens")
        self.ids = {tok: i for i, tok in enumerate(self.vocab)}
        self.sp = spm.SentencePieceProcessor()
        spm_path = file_inside(export_dir, SPM, export_dir, None, CT2Error)
        try:
            self.sp.Load(str(spm_path))
        except (OSError, RuntimeError) as exc:
            raise CT2Error(f"{spm_path}: not a readable SentencePiece model ({exc})") from None
        self.tags = language_tags(self.sp)
        pieces = self.sp.get_piece_size()
        if pieces > len(self.vocab):
            raise CT2Error(f"{spm_path}: {pieces} pieces, but {vocab_path} has {len(self.vocab)}")
        special = {PAD_ID, BOS_ID, *self.tags.values(), *range(pieces, len(self.vocab))}
        self.banned_ids = sorted({*special, UNK_ID})
        self.suppressed = [[self.vocab[i]] for i in sorted(special)]
        self.positions = self.meta["max_positions"]
        self.truncated = 0
        try:
            self.ct2 = ctranslate2.Translator(
                str(export_dir), device="cpu", compute_type=compute_type, intra_threads=threads
            )
        except (RuntimeError, ValueError) as exc:
            raise CT2Error(
                f"{export_dir}: ctranslate2 cannot load it ({one_line(str(exc))})"
            ) from None
        self.engine = f"{ENGINE} {self.ct2.compute_type}"

    @property
    def max_positions(self) -> int:
        """The export's position table (export.json)."""
        return self.positions

    @classmethod
    def from_export(cls, export_dir: str | Path, device: str = "cpu") -> CT2Translator:
        """Load a CTranslate2 export (CPU, the export's quantization)."""
        return cls(export_dir)

    def limit(self, src_len: int, opts: SearchOptions) -> int:
        """Most tokens before EOS for a source of ``src_len`` ids (beam_search.max_lengths)."""
        return max(0, min(math.floor(opts.max_len_a * src_len + opts.max_len_b),
                          self.max_positions - 1))  # fmt: skip

    def translate_hypotheses(
        self,
        lines: Sequence[str],
        src_lang: str,
        tgt_lang: str,
        opts: SearchOptions | None = None,
        progress: Callable[[int], None] | None = None,
    ) -> list[list[Hypothesis]]:
        """Per line its best hypotheses (empty list for an empty line), in input order."""
        opts, results, todo = self.start_search(lines, src_lang, tgt_lang, opts, progress)
        by_limit: dict[int, list[tuple[int, int, list[str]]]] = {}
        for i in todo:
            ids = self.encode(lines[i], tgt_lang)
            limit = self.limit(len(ids), opts)
            by_limit.setdefault(limit, []).append((i, limit, [self.vocab[t] for t in ids]))
        for group in _merge_small(by_limit):
            limit = max(lim for _, lim, _ in group)
            out = self.ct2.translate_batch(
                [tokens for _, _, tokens in group],
                beam_size=opts.beam,
                length_penalty=opts.lenpen,
                num_hypotheses=opts.nbest,
                max_decoding_length=limit + 1,
                min_decoding_length=0,
                max_input_length=self.max_positions,
                max_batch_size=opts.batch_tokens,
                batch_type="tokens",
                suppress_sequences=self.suppressed,
                disable_unk=True,
                return_scores=True,
            )
            for (i, own, _), result in zip(group, out, strict=True):
                results[i] = [
                    self._hypothesis(tokens, score, own, opts.lenpen)
                    for tokens, score in zip(result.hypotheses, result.scores, strict=True)
                ]
            if progress is not None:
                progress(len(group))
        return results

    def _hypothesis(self, tokens: list[str], score: float, limit: int, lenpen: float) -> Hypothesis:
        """A hypothesis cut to the sentence's own limit (its group may decode further)."""
        ids = [self.ids[t] for t in tokens]
        return Hypothesis(ids[:limit], score, score * (len(ids) + 1) ** lenpen)


MIN_CALL = 32
"""Fewest sentences per translate_batch call: sentences of neighbouring length limits share a
call (decoded to the largest limit, each output cut to its own), since a call of a few
sentences leaves CTranslate2's matrix products a row or two (a 6L-6L d=512 model ran 4x slower
at float32 when each source length had a call of its own)."""


def _merge_small(
    by_limit: dict[int, list[tuple[int, int, list[str]]]],
) -> list[list[tuple[int, int, list[str]]]]:
    """The sentences grouped by length limit, neighbouring limits merged until a group has
    :data:`MIN_CALL` sentences."""
    groups: list[list[tuple[int, int, list[str]]]] = []
    current: list[tuple[int, int, list[str]]] = []
    for limit in sorted(by_limit):
        current += by_limit[limit]
        if len(current) >= MIN_CALL:
            groups.append(current)
            current = []
    if current:
        groups.append(current)
    return groups
