"""The beam-search decoding path: preallocated step caches (grouped cross-attention, reorders,
sentences leaving) against the uncached forward, and beam search against a slow reference."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_branchnorm.inference.beam_search import beam_search
from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.model.attention import StepCache
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from .helpers import tiny_config

ATOL = 1e-5
BANNED = [PAD_ID, BOS_ID, UNK_ID]


def _sources(vocab: int) -> torch.Tensor:
    """Three sentences, the middle one shorter (padding)."""
    src = torch.randint(UNK_ID + 1, vocab, (3, 7), generator=torch.Generator().manual_seed(0))
    src[:, -1] = EOS_ID
    src[1, 3], src[1, 4:] = EOS_ID, PAD_ID
    return src


@pytest.mark.parametrize("residual", ["postln", "branchnorm"])
def test_step_caches_match_the_full_forward_through_reorders(residual: str) -> None:
    """Steps of G rows per sentence with random beam reorders (duplicates included), an
    identity step (no reorder), a sentence leaving, and the transposed output weight on
    every other step: each step's logits equal the uncached forward of the row's history."""
    model = build_model(tiny_config(residual=residual, branchnorm_steps=10), seed=2).eval()
    model.set_step(7)
    src, group = _sources(model.cfg.vocab_size), 3
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        memory, pad_mask = model.encode(src)  # one row per sentence, all steps
        caches = model.new_step_caches(8)
        out_t = model.output_weight_t()
        sents = torch.arange(3)  # original sentence of each memory row
        hist = torch.full((3, 1), BOS_ID)  # (rows, 1 + step): step 0 has one row per sentence
        for step in range(7):
            per = hist.shape[0] // sents.numel()
            logits = model.decode_step(
                hist[:, -1], memory, pad_mask, caches, step, out_t if step % 2 else None
            )
            full = model(src[sents].repeat_interleave(per, 0), hist)[:, -1]
            torch.testing.assert_close(logits, full, rtol=0, atol=ATOL)

            keep = torch.tensor([0, 2]) if step == 3 else torch.arange(sents.numel())
            if step == 5:  # the order does not change: nothing to copy
                rows = None
            else:  # each kept sentence's new rows come from its own rows, in any order
                picks = torch.randint(0, per, (keep.numel(), group), generator=gen)
                rows = (keep[:, None] * per + picks).view(-1)
            model.reorder_step_caches(caches, rows, keep if step == 3 else None)
            if step == 3:
                memory, pad_mask, sents = memory[keep], pad_mask[keep], sents[keep]
            new = torch.randint(UNK_ID + 1, model.cfg.vocab_size, (keep.numel() * group, 1))
            hist = torch.cat([hist if rows is None else hist[rows], new], dim=1)


def test_step_cache_is_bounded_and_keeps_its_batch() -> None:
    cache = StepCache(max_len=2)
    cache.append(torch.zeros(3, 8))
    with pytest.raises(ValueError, match="rows"):
        cache.append(torch.zeros(4, 8))
    cache.append(torch.zeros(3, 8))
    with pytest.raises(ValueError, match="full"):
        cache.append(torch.zeros(3, 8))


def _reference_beam_search(
    model: EncoderDecoder, src: torch.Tensor, beam: int, lenpen: float, limit: int
) -> list[tuple[list[int], float]]:
    """One sentence, no cache: every candidate from a full forward of its prefix; the same
    rules (the 2K best extensions; an EOS among the first K closes; the first K others go on;
    only EOS at the limit)."""
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    for step in range(limit + 1):
        cands = []
        for toks, score in beams:
            with torch.no_grad():
                logits = model(src[None], torch.tensor([[BOS_ID, *toks]]))[0, -1]
            lp = torch.log_softmax(logits, dim=-1)
            lp[BANNED] = -math.inf
            if step >= limit:
                lp[torch.arange(lp.numel()) != EOS_ID] = -math.inf
            cands += [(score + float(lp[v]), toks, v) for v in range(lp.numel())]
        cands.sort(key=lambda c: -c[0])
        beams = []
        for rank, (score, toks, v) in enumerate(cands[: 2 * beam]):
            if v == EOS_ID and rank < beam and math.isfinite(score) and len(finished) < beam:
                finished.append((toks, score / (step + 1) ** lenpen))
            elif v != EOS_ID and len(beams) < beam:
                beams.append(([*toks, v], score))
        if len(finished) >= beam:
            break
    return sorted(finished, key=lambda h: -h[1])


@pytest.mark.parametrize(("seed", "beam"), [(0, 1), (1, 2), (2, 3), (3, 5)])
def test_beam_search_equals_the_uncached_reference(seed: int, beam: int) -> None:
    model = build_model(tiny_config(vocab_size=12), seed=seed).eval()
    src = _sources(12)
    hyps = beam_search(
        model, src, beam=beam, lenpen=0.6, max_len_a=0, max_len_b=4, nbest=beam, banned_ids=BANNED
    )
    for row, got in zip(src, hyps, strict=True):
        ref = _reference_beam_search(model, row[row.ne(PAD_ID)], beam, 0.6, 4)
        assert [h.tokens for h in got] == [toks for toks, _ in ref]
        assert [h.score for h in got] == pytest.approx([s for _, s in ref], abs=1e-5)
