"""Beam search: greedy equivalence, exhaustive optimality, banned ids, length limits, copy."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_branchnorm.inference.beam_search import beam_search, greedy_search, max_lengths
from megatron_branchnorm.model import EncoderDecoder, build_model
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID, UNK_ID

from .helpers import COPY_TAG, copy_batch, copy_words, tiny_config

BANNED = [PAD_ID, BOS_ID, UNK_ID]


def _full_lprobs(model: EncoderDecoder, src: torch.Tensor, prefix: list[int]) -> torch.Tensor:
    """Log-probabilities of the next token after BOS + prefix, by a full forward (no cache)."""
    with torch.no_grad():
        logits = model(src[None], torch.tensor([[BOS_ID, *prefix]]))[0, -1]
    lp = torch.log_softmax(logits, dim=-1)
    lp[BANNED] = float("-inf")
    return lp


def _naive_greedy(model: EncoderDecoder, src: torch.Tensor, max_len: int) -> list[int]:
    out: list[int] = []
    while len(out) < max_len:
        nxt = int(_full_lprobs(model, src, out).argmax())
        if nxt == EOS_ID:
            break
        out.append(nxt)
    return out


def _sequence_score(
    model: EncoderDecoder, src: torch.Tensor, seq: list[int], lenpen: float
) -> float:
    with torch.no_grad():
        logits = model(src[None], torch.tensor([[BOS_ID, *seq]]))[0]
    lp = torch.log_softmax(logits, dim=-1)
    total = sum(float(lp[i, t]) for i, t in enumerate([*seq, EOS_ID]))
    return total / (len(seq) + 1) ** lenpen


def _sources() -> torch.Tensor:
    src = torch.tensor([[4, 9, 17, 22, 5, EOS_ID], [30, 7, EOS_ID, PAD_ID, PAD_ID, PAD_ID]])
    return src


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_one_equals_naive_greedy(seed):
    model = build_model(tiny_config(), seed=seed).eval()
    src = _sources()
    hyps = beam_search(model, src, beam=1, max_len_a=0, max_len_b=8, banned_ids=BANNED)
    for row, h in zip(src, hyps, strict=True):
        words = row[row.ne(PAD_ID)]
        assert h[0].tokens == _naive_greedy(model, words, 8)
    assert [h.tokens for h in greedy_search(model, src, 0, 8, BANNED)] == [
        h[0].tokens for h in hyps
    ]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_beam_scores_at_least_greedy_and_scores_are_consistent(seed):
    model = build_model(tiny_config(), seed=seed).eval()
    src = _sources()
    greedy = beam_search(model, src, beam=1, max_len_a=0, max_len_b=8, banned_ids=BANNED)
    beam = beam_search(
        model, src, beam=5, lenpen=0.0, max_len_a=0, max_len_b=8, nbest=5, banned_ids=BANNED
    )
    for row, g, b in zip(src, greedy, beam, strict=True):
        words = row[row.ne(PAD_ID)]
        assert b[0].log_prob >= g[0].log_prob - 1e-5
        assert [h.score for h in b] == sorted((h.score for h in b), reverse=True)
        for h in b:  # the reported score is the sequence's log-probability (lenpen 0)
            assert h.score == pytest.approx(_sequence_score(model, words, h.tokens, 0.0), abs=1e-4)


def _all_sequence_log_probs(
    model: EncoderDecoder, src: torch.Tensor, seqs: list[list[int]]
) -> list[float]:
    """log p(seq + EOS | src) of every sequence, in one padded forward (causal: the padding
    after a sequence does not change its positions)."""
    width = max(len(q) for q in seqs) + 1
    prev = torch.full((len(seqs), width), PAD_ID)
    for i, q in enumerate(seqs):
        prev[i, : len(q) + 1] = torch.tensor([BOS_ID, *q])
    with torch.no_grad():
        lp = torch.log_softmax(model(src.expand(len(seqs), -1), prev), dim=-1)
    return [sum(float(lp[i, j, t]) for j, t in enumerate([*q, EOS_ID])) for i, q in enumerate(seqs)]


def test_large_beam_finds_exhaustive_best():
    """Vocabulary of 4 words + EOS, at most 3 words: 85 sequences, all enumerable."""
    model = build_model(tiny_config(vocab_size=8), seed=3).eval()
    src = torch.tensor([[4, 5, 6, EOS_ID], [7, 5, EOS_ID, PAD_ID]])
    seqs = [list(q) for n in range(4) for q in itertools.product(range(4, 8), repeat=n)]
    log_probs = [_all_sequence_log_probs(model, row[row.ne(PAD_ID)][None], seqs) for row in src]
    for lenpen in (0.0, 0.6, 1.0):
        hyps = beam_search(
            model, src, beam=128, lenpen=lenpen, max_len_a=0, max_len_b=3, banned_ids=BANNED
        )
        for h, lps in zip(hyps, log_probs, strict=True):
            best = max((lp / (len(q) + 1) ** lenpen, q) for lp, q in zip(lps, seqs, strict=True))
            assert h[0].tokens == best[1]
            assert h[0].score == pytest.approx(best[0], abs=1e-5)


def test_banned_ids_never_generated_and_length_limit():
    model = build_model(tiny_config(), seed=4).eval()
    src = _sources()
    tags = list(range(4, 12))
    hyps = beam_search(
        model, src, beam=4, max_len_a=1.0, max_len_b=2, nbest=4, banned_ids=BANNED + tags
    )
    limits = max_lengths(src, 1.0, 2, model.cfg.max_positions).tolist()
    assert limits == [8, 5]
    for h_list, limit in zip(hyps, limits, strict=True):
        assert len(h_list) == 4
        for h in h_list:
            assert len(h.tokens) <= limit
            assert not set(h.tokens) & set(BANNED + tags + [EOS_ID])


def test_limit_zero_and_position_table_cap():
    model = build_model(tiny_config(max_positions=16), seed=4).eval()
    src = _sources()
    assert max_lengths(src, 5.0, 100, 16).tolist() == [15, 15]
    hyps = beam_search(model, src, beam=2, max_len_a=0, max_len_b=0, banned_ids=BANNED)
    assert [h[0].tokens for h in hyps] == [[], []]
    with pytest.raises(ValueError, match="nbest"):
        beam_search(model, src, beam=2, nbest=3)


def test_result_does_not_depend_on_batch_company():
    model = build_model(tiny_config(), seed=6).eval()
    src = _sources()
    together = beam_search(model, src, beam=4, banned_ids=BANNED)
    alone = beam_search(model, src[1:, :3], beam=4, banned_ids=BANNED)
    assert together[1][0].tokens == alone[0][0].tokens


def test_trained_copy_model_copies(copy_model):
    src, _, _ = copy_batch(32, torch.Generator().manual_seed(123))
    hyps = beam_search(copy_model, src, beam=4, banned_ids=BANNED + [COPY_TAG])
    copied = sum(h[0].tokens == copy_words(row) for h, row in zip(hyps, src, strict=True))
    assert copied >= 28, f"copied {copied}/32"
    greedy = beam_search(copy_model, src, beam=1, banned_ids=BANNED + [COPY_TAG])
    assert sum(h[0].tokens == copy_words(row) for h, row in zip(greedy, src, strict=True)) >= 26
