"""Training the joint SentencePiece model, deterministically.

The training text is a temperature-sampled mix of the languages' training sentences (small
languages are repeated, large ones subsampled), drawn with a seeded generator
(:func:`sample_plan` says which sentences, so a caller can read just those from disk);
SentencePiece itself runs with its random seed fixed and one thread (more threads give another
model), so the same corpus and options give the same model file. Special ids follow :mod:`megatron_branchnorm.tokens`; every language's ``<2xx>``
tag is a user-defined symbol, so tags get the ids right after ``</s>`` in language order.
"""

from __future__ import annotations

import gc
import io
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import sentencepiece as sp

from megatron_branchnorm.data.sampling import allocate, temperature_probs
from megatron_branchnorm.formats.data_dir import DataError
from megatron_branchnorm.tokens import SPM_SPECIALS, lang_tag

MODEL_TYPES = ("unigram", "bpe", "char", "word")


@dataclass
class SpmOptions:
    """Options of the joint SentencePiece model."""

    vocab_size: int = 64000
    model_type: str = "unigram"
    character_coverage: float = 0.9995
    sample_size: int = 2_000_000
    """Sentences in the training mix (fewer when the corpus is smaller)."""
    temperature: float = 5.0
    """Language-mix temperature for the training sample."""
    seed: int = 1


def sample_plan(counts: dict[str, int], opts: SpmOptions) -> dict[str, np.ndarray]:
    """Which sentences of each language (by index in its training text; languages in sorted
    order) make up the training mix: a language below its temperature share is repeated
    (whole passes in order), then a seeded sample in index order tops it up."""
    langs = sorted(counts)
    sizes = [counts[lang] for lang in langs]
    if sum(sizes) == 0:
        raise DataError("no training sentences left to train SentencePiece on")
    total = min(opts.sample_size, sum(sizes))
    take = allocate(total, temperature_probs(sizes, opts.temperature))
    plan = {}
    for i, lang in enumerate(langs):
        size, k = sizes[i], int(take[i])
        rng = np.random.default_rng([opts.seed, i])
        reps, extra = divmod(k, size) if size else (0, 0)
        plan[lang] = (
            np.concatenate(
                [np.arange(size)] * reps + [np.sort(rng.choice(size, extra, replace=False))]
            )
            if size
            else np.zeros(0, np.int64)
        )
    return plan


def sample_mix(
    sentences: dict[str, list[str]], opts: SpmOptions
) -> tuple[list[str], dict[str, int]]:
    """The training sentences of :func:`sample_plan` (languages in sorted order) and how many
    came from each language."""
    plan = sample_plan({lang: len(pool) for lang, pool in sentences.items()}, opts)
    mix: list[str] = []
    for lang, idx in plan.items():
        mix.extend(sentences[lang][j] for j in idx.tolist())
    return mix, {lang: int(idx.size) for lang, idx in plan.items()}


def train_spm(
    sentences: Iterable[str],
    count: int,
    model_prefix: str | Path,
    languages: list[str],
    opts: SpmOptions,
) -> dict:
    """Train ``model_prefix.model`` (and a ``.vocab`` listing: piece, tab, score) on
    ``sentences`` (``count`` of them, the mix of :func:`sample_plan`) and return what the
    manifest records about it (all but ``sample_sentences``)."""
    if opts.model_type not in MODEL_TYPES:
        raise DataError(f"--model-type must be one of {', '.join(MODEL_TYPES)}")
    model_prefix = Path(model_prefix)
    # Sentences go in through an iterator and the model comes back as bytes, so no file path
    # ends up in the model's trainer spec and the file depends only on the data and options.
    writer = io.BytesIO()
    tags = [lang_tag(lang) for lang in sorted(languages)]
    sp.set_random_generator_seed(opts.seed)
    try:
        sp.SentencePieceTrainer.train(
            sentence_iterator=iter(sentences),
            model_writer=writer,
            vocab_size=opts.vocab_size,
            model_type=opts.model_type,
            character_coverage=opts.character_coverage,
            **SPM_SPECIALS,
            user_defined_symbols=tags,
            # More threads change the model (measured: docs/data.md, "SentencePiece").
            num_threads=1,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            minloglevel=2,
        )
    except RuntimeError as exc:
        msg = " ".join(str(exc).split())
        raise DataError(f"SentencePiece training on {count} sentences failed: {msg}") from None
    proto = writer.getvalue()
    Path(f"{model_prefix}.model").write_bytes(proto)
    model = sp.SentencePieceProcessor(model_proto=proto)
    with open(f"{model_prefix}.vocab", "w", encoding="utf-8", newline="\n") as f:
        for i in range(model.get_piece_size()):
            f.write(f"{model.id_to_piece(i)}\t{model.get_score(i):g}\n")
    tag_ids = {lang: model.piece_to_id(lang_tag(lang)) for lang in sorted(languages)}
    for lang, tid in tag_ids.items():
        if model.id_to_piece(tid) != lang_tag(lang):
            raise DataError(f"{model_prefix}.model: tag {lang_tag(lang)} is not a single piece")
    return {
        "vocab_size": model.get_piece_size(),
        "tag_ids": tag_ids,
        "model_type": opts.model_type,
        "character_coverage": opts.character_coverage,
        "temperature": opts.temperature,
        "seed": opts.seed,
    }


_worker_model: sp.SentencePieceProcessor | None = None


def init_worker(model_file: str, pool_worker: bool = True) -> None:
    """Load the model once per process (as a pool initializer, or in-process with
    ``pool_worker=False``)."""
    global _worker_model
    if pool_worker:
        gc.freeze()  # the corpus inherited from the parent never needs collecting here
    _worker_model = sp.SentencePieceProcessor(model_file=model_file)


def encode_chunk(lines: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode lines with the worker's model: (concatenated ids as int32, lengths as int64)."""
    if _worker_model is None:
        raise RuntimeError("encode_chunk needs init_worker first")
    # One thread per process: --workers alone decides how many cores encoding uses.
    pieces = _worker_model.encode(lines, out_type=int, num_threads=1)
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    flat = np.fromiter(chain.from_iterable(pieces), dtype=np.int32, count=int(lengths.sum()))
    return flat, lengths
