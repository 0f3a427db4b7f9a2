"""Batched beam search with the decoder's key/value cache, scored as fairseq scores it.

    hyps = beam_search(model, src_tokens, beam=4, lenpen=0.6, banned_ids=[PAD_ID, BOS_ID, UNK_ID])
    best = hyps[0][0].tokens          # ids of sentence 0's best translation, EOS excluded

A hypothesis of n generated tokens (its EOS included) scores ``sum(log p) / n ** lenpen``.
Each step takes the 2K best extensions of the K live beams of a sentence; an EOS among the first
K of them closes a hypothesis, the first K others stay live. A sentence is done once K
hypotheses are closed or it reaches its length limit ``max_len_a * src_len + b`` (src_len
counts the language tag and EOS), where only EOS may follow. Banned ids (padding, BOS, UNK,
language tags) get log-probability -inf after the softmax. With ``beam=1`` this is greedy
decoding. Finished sentences leave the batch, so a sentence's result does not depend on which
sentences share its batch (up to floating-point noise from padding).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_branchnorm.model import EncoderDecoder
from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID

NEG_INF = -math.inf


@dataclass
class Hypothesis:
    """One finished translation."""

    tokens: list[int]
    """Generated ids, EOS excluded."""
    score: float
    """Length-normalised score: log_prob / (len(tokens) + 1) ** lenpen."""
    log_prob: float
    """Sum of the log-probabilities of the tokens and the EOS."""


def max_lengths(
    src_tokens: torch.Tensor, max_len_a: float, max_len_b: int, max_positions: int
) -> torch.Tensor:
    """(B,) most tokens before EOS per sentence: a * src_len + b, within the position table
    (the BOS takes position 0, so at most max_positions - 1 more)."""
    src_lens = src_tokens.ne(PAD_ID).sum(dim=1).double()
    limit = torch.floor(max_len_a * src_lens + max_len_b).long()
    return limit.clamp(min=0, max=max_positions - 1)


@torch.inference_mode()
def beam_search(
    model: EncoderDecoder,
    src_tokens: torch.Tensor,
    beam: int = 4,
    lenpen: float = 0.6,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    nbest: int = 1,
    banned_ids: Sequence[int] = (),
) -> list[list[Hypothesis]]:
    """Translate a padded batch ``src_tokens`` (B, S); returns per sentence its ``nbest`` best
    hypotheses, best first."""
    if beam < 1:
        raise ValueError(f"beam must be >= 1, got {beam}")
    if not 1 <= nbest <= beam:
        raise ValueError(f"nbest must be in [1, beam={beam}], got {nbest}")
    model.eval()
    device = src_tokens.device
    bsz, k = src_tokens.shape[0], beam
    limits_t = max_lengths(src_tokens, max_len_a, max_len_b, model.cfg.max_positions)
    limits = limits_t.tolist()
    banned = torch.tensor(sorted({int(i) for i in banned_ids} - {EOS_ID}), dtype=torch.long)
    banned = banned.to(device)

    # Memory, padding mask and cross-attention keys/values stay one row per sentence (its
    # beams share them); the token rows are the live beams, sentence-major: one per sentence
    # at step 0 (the other beams would be copies with score -inf), then K.
    memory, pad_mask = model.encode(src_tokens)  # (n, S, C), (n, S)
    caches = model.new_step_caches(max(limits) + 1)
    out_t = model.output_weight_t()  # (C, V): a contiguous copy makes the logits matmul faster
    tokens = torch.full((bsz, 1), BOS_ID, dtype=torch.long, device=device)  # (n*k', 1 + t)
    scores = torch.zeros((bsz, 1), device=device)  # (n, k'): live beams' log-probabilities
    live = list(range(bsz))  # original index of each sentence still in the batch
    finished: list[list[Hypothesis]] = [[] for _ in range(bsz)]

    for step in range(max(limits) + 1):
        n, kk = scores.shape
        logits = model.decode_step(tokens[:, -1], memory, pad_mask, caches, step, out_t)
        lprobs = F.log_softmax(logits.float(), dim=-1)
        vocab = lprobs.shape[-1]
        if banned.numel():
            lprobs.index_fill_(1, banned, NEG_INF)
        if step >= min(limits[s] for s in live):  # some sentence at its limit: only EOS
            forced = limits_t.index_select(0, torch.tensor(live, device=device)).le(step)
            forced = forced.repeat_interleave(kk)
            eos_lp = lprobs[forced, EOS_ID].clone()
            lprobs[forced] = NEG_INF
            lprobs[forced, EOS_ID] = eos_lp

        # The best 2K of a sentence are among the best 2K of each of its rows: select per
        # row, then among the (n, k' * 2K) sums (one small add, not one per vocabulary entry).
        row_lp, row_tok = lprobs.topk(min(2 * k, vocab), dim=1)  # (n*k', w)
        width = row_lp.shape[1]
        cand = (row_lp + scores.view(n * kk, 1)).view(n, kk * width)
        top_scores, top_idx = _topk_padded(cand, 2 * k)  # (n, 2K)
        top_beam, top_tok = top_idx // width, row_tok.view(n, kk * width).gather(1, top_idx)
        is_eos = top_tok.eq(EOS_ID)

        # Close hypotheses: an EOS within the first K candidates with a finite score.
        closing = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])
        for i, r in closing.nonzero().tolist():
            hyps = finished[live[i]]
            if len(hyps) >= k:
                continue
            raw = float(top_scores[i, r])
            prefix = tokens[i * kk + int(top_beam[i, r]), 1:].tolist()
            hyps.append(Hypothesis(prefix, raw / float(step + 1) ** lenpen, raw))

        keep = [i for i, s in enumerate(live) if len(finished[s]) < k and step < limits[s]]
        if not keep:
            break
        # The first K non-EOS candidates continue (there are at least K: one EOS per beam).
        rank = torch.arange(2 * k, device=device).expand_as(top_idx)
        order = (rank + is_eos.long() * 2 * k).argsort(dim=1)[:, :k]  # (n, K)
        removed = len(keep) != n
        if removed:
            keep_t = torch.tensor(keep, device=device)
            order = order.index_select(0, keep_t)
            top_scores, top_beam, top_tok = (
                x.index_select(0, keep_t) for x in (top_scores, top_beam, top_tok)
            )
            memory, pad_mask = memory.index_select(0, keep_t), pad_mask.index_select(0, keep_t)
            row0 = keep_t[:, None] * kk
        else:
            keep_t = None
            row0 = torch.arange(0, n * kk, kk, device=device)[:, None]
        scores, next_beam, next_tok = (x.gather(1, order) for x in (top_scores, top_beam, top_tok))
        src_rows = (row0 + next_beam).view(-1)  # (n'*K,) rows of the old batch

        tokens = torch.cat([tokens.index_select(0, src_rows), next_tok.view(-1, 1)], dim=1)
        same_rows = src_rows.numel() == n * kk and torch.equal(
            src_rows, torch.arange(n * kk, device=device)
        )
        model.reorder_step_caches(caches, None if same_rows else src_rows, keep_t)
        live = [live[i] for i in keep]

    out = []
    for hyps in finished:
        hyps.sort(key=lambda h: h.score, reverse=True)
        out.append(hyps[:nbest])
    return out


def _topk_padded(cand: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top ``m`` of each row of ``cand`` (n, N); with N < m, padded with -inf candidates at
    index N - 1 (score -inf: they never close a hypothesis, and a beam continued from one
    stays at -inf, as a beam with no finite candidate left did before)."""
    if cand.shape[1] >= m:
        return cand.topk(m, dim=1)
    vals, idx = cand.topk(cand.shape[1], dim=1)
    pad = m - cand.shape[1]
    vals = F.pad(vals, (0, pad), value=NEG_INF)
    return vals, F.pad(idx, (0, pad), value=cand.shape[1] - 1)


@torch.no_grad()
def greedy_search(
    model: EncoderDecoder,
    src_tokens: torch.Tensor,
    max_len_a: float = 1.2,
    max_len_b: int = 10,
    banned_ids: Sequence[int] = (),
) -> list[Hypothesis]:
    """Greedy decoding (beam search with one beam; length penalty irrelevant)."""
    return [
        h[0] for h in beam_search(model, src_tokens, 1, 0.0, max_len_a, max_len_b, 1, banned_ids)
    ]
