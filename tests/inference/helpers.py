"""Helpers for the inference tests: tiny configs, a copy-task model trained in seconds, and a
SentencePiece model trained from a few hundred generated lines."""

from __future__ import annotations

import random
from pathlib import Path

import torch
import torch.nn.functional as F

from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, SPM_SPECIALS, lang_tag
from tests.core.helpers import tiny_config

COPY_VOCAB = 16
COPY_TAG = 4  # the one "language tag" of the copy task
COPY_FIRST_WORD = 5
LANGS = ("de", "en", "zh")


def copy_batch(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src, prev_output_tokens, target) of ``n`` random copy examples of 2-6 words."""
    lens = torch.randint(2, 7, (n,), generator=gen).tolist()
    width = max(lens)
    words = torch.randint(COPY_FIRST_WORD, COPY_VOCAB, (n, width), generator=gen)
    src = torch.full((n, width + 2), PAD_ID)
    prev = torch.full((n, width + 1), PAD_ID)
    tgt = torch.full((n, width + 1), PAD_ID)
    for i, n_words in enumerate(lens):
        w = words[i, :n_words]
        src[i, 0], src[i, 1 : n_words + 1], src[i, n_words + 1] = COPY_TAG, w, EOS_ID
        prev[i, 0], prev[i, 1 : n_words + 1] = BOS_ID, w
        tgt[i, :n_words], tgt[i, n_words] = w, EOS_ID
    return src, prev, tgt


def copy_words(src_row: torch.Tensor) -> list[int]:
    """The words of a copy-task source row (tag, EOS and padding removed)."""
    return [t for t in src_row.tolist() if t >= COPY_FIRST_WORD]


def train_copy_model(steps: int = 200, residual: str = "postln") -> EncoderDecoder:
    """A 2L-2L d=32 model trained to copy its input (a few seconds on one CPU thread)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        cfg = tiny_config(vocab_size=COPY_VOCAB, residual=residual, branchnorm_steps=steps)
        model = build_model(cfg, seed=1)
        opt = torch.optim.Adam(model.parameters(), lr=5e-3, betas=(0.9, 0.98))
        gen = torch.Generator().manual_seed(0)
        for step in range(1, steps + 1):
            model.set_step(step)
            src, prev, tgt = copy_batch(64, gen)
            logits = model(src, prev)
            loss = F.cross_entropy(logits.view(-1, COPY_VOCAB), tgt.view(-1), ignore_index=PAD_ID)
            opt.zero_grad()
            loss.backward()
            opt.step()
    finally:
        torch.set_num_threads(threads)
    return model.eval()


WORDS = (
    "the a cat dog sits runs on under mat house big small red green blue quickly slowly "
    "open close file window save print"
).split()
ZH_CHARS = "我你他是的猫狗在上下大小红绿蓝文件窗口保存打印"


def sentences(n: int, seed: int = 0) -> dict[str, list[str]]:
    """Parallel-looking generated text per language (same length, no real meaning)."""
    rng = random.Random(seed)
    out: dict[str, list[str]] = {lang: [] for lang in LANGS}
    for _ in range(n):
        k = rng.randint(3, 9)
        en = [rng.choice(WORDS) for _ in range(k)]
        out["en"].append(" ".join(en).capitalize() + ".")
        out["de"].append(" ".join(w[::-1] for w in en).capitalize() + ".")
        out["zh"].append("".join(rng.choice(ZH_CHARS) for _ in range(k)) + "。")
    return out


def train_spm(out_dir: Path, vocab_size: int = 96) -> Path:
    """A SentencePiece model with our special ids and <2xx> tags, from a few hundred lines."""
    import sentencepiece as spm

    text = out_dir / "spm_train.txt"
    lines = [s for lang_lines in sentences(300).values() for s in lang_lines]
    text.write_text("\n".join(lines) + "\n", encoding="utf-8")
    prefix = out_dir / "spm"
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(prefix),
        vocab_size=vocab_size,
        **SPM_SPECIALS,
        user_defined_symbols=[lang_tag(lang) for lang in LANGS],
        character_coverage=1.0,
        num_threads=1,
        minloglevel=2,
    )
    return Path(f"{prefix}.model")
