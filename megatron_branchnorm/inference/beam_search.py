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


@torch.no_grad()
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
    limits = max_lengths(src_tokens, max_len_a, max_len_b, model.cfg.max_positions).tolist()
    banned = torch.tensor(sorted({int(i) for i in banned_ids} - {EOS_ID}), dtype=torch.long)
    banned = banned.to(device)

    memory, pad_mask = model.encode(src_tokens)  # (B, S, C), (B, S)
    rows = torch.arange(bsz, device=device).repeat_interleave(k)
    memory, pad_mask = memory.index_select(0, rows), pad_mask.index_select(0, rows)  # (B*K, ...)
    caches = model.new_caches()
    tokens = torch.full((bsz * k, 1), BOS_ID, dtype=torch.long, device=device)  # (n*K, 1 + t)
    scores = torch.full((bsz, k), NEG_INF, device=device)
    scores[:, 0] = 0.0  # only the first beam of a sentence is live at the start
    live = list(range(bsz))  # original index of each sentence still in the batch
    finished: list[list[Hypothesis]] = [[] for _ in range(bsz)]

    for step in range(max(limits) + 1):
        n = len(live)
        logits = model.decode_step(tokens[:, -1], memory, pad_mask, caches, step)  # (n*K, V)
        lprobs = F.log_softmax(logits.float(), dim=-1)
        vocab = lprobs.shape[-1]
        if banned.numel():
            lprobs.index_fill_(1, banned, NEG_INF)
        at_limit = torch.tensor([step >= limits[s] for s in live], device=device)
        if bool(at_limit.any()):
            forced = at_limit.repeat_interleave(k)
            eos_lp = lprobs[forced, EOS_ID].clone()
            lprobs[forced] = NEG_INF
            lprobs[forced, EOS_ID] = eos_lp

        cand = (scores.view(n * k, 1) + lprobs).view(n, k * vocab)
        top_scores, top_idx = cand.topk(min(2 * k, k * vocab), dim=1)  # (n, 2K)
        top_beam, top_tok = top_idx // vocab, top_idx % vocab
        is_eos = top_tok.eq(EOS_ID)

        # Close hypotheses: an EOS within the first K candidates with a finite score.
        closing = is_eos[:, :k] & torch.isfinite(top_scores[:, :k])
        for i, r in closing.nonzero().tolist():
            hyps = finished[live[i]]
            if len(hyps) >= k:
                continue
            raw = float(top_scores[i, r])
            prefix = tokens[i * k + int(top_beam[i, r]), 1:].tolist()
            hyps.append(Hypothesis(prefix, raw / float(step + 1) ** lenpen, raw))

        keep = [i for i, s in enumerate(live) if len(finished[s]) < k and step < limits[s]]
        if not keep:
            break
        # The first K non-EOS candidates continue (there are at least K: one EOS per beam).
        rank = torch.arange(top_idx.shape[1], device=device).expand_as(top_idx)
        order = (rank + is_eos.long() * top_idx.shape[1]).argsort(dim=1)[:, :k]  # (n, K)
        keep_t = torch.tensor(keep, device=device)
        order = order.index_select(0, keep_t)
        next_scores = top_scores.index_select(0, keep_t).gather(1, order)
        next_beam = top_beam.index_select(0, keep_t).gather(1, order)
        next_tok = top_tok.index_select(0, keep_t).gather(1, order)
        src_rows = (keep_t[:, None] * k + next_beam).view(-1)  # (n'*K,) rows of the old batch

        tokens = torch.cat([tokens.index_select(0, src_rows), next_tok.view(-1, 1)], dim=1)
        scores = next_scores
        # Beams of one sentence share memory, padding and cross-attention rows: those are
        # reordered only when sentences leave the batch.
        removed = len(keep) != n
        model.reorder_caches(caches, src_rows, cross=removed)
        if removed:
            pad_mask = pad_mask.index_select(0, src_rows)
            memory = memory.index_select(0, src_rows)
        live = [live[i] for i in keep]

    out = []
    for hyps in finished:
        hyps.sort(key=lambda h: h.score, reverse=True)
        out.append(hyps[:nbest])
    return out


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
