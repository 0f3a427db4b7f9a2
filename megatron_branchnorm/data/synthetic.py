"""A deterministic synthetic translation task (copy or reverse), like fairseq's dummy MT data.

Pair i: a task token (<copy> or <reverse>) and a random token sequence as source, the sequence
or its reverse as target. Content depends only on (i, the vocabulary, max_length); the batch
order depends on the training seed and epoch. Used for smoke tests and benchmarks.
"""

from __future__ import annotations

import numpy as np
import torch

from megatron_branchnorm.data.dataset import pair_batch
from megatron_branchnorm.data.indexed_dataset import ragged_cells
from megatron_branchnorm.tokens import EOS_ID

FIRST_WORD = 6  # 0-3 specials, 4 <copy>, 5 <reverse>
COPY, REVERSE = 4, 5


class SyntheticData:
    """``size`` pairs of the copy/reverse task over a vocabulary of ``vocab_size``."""

    def __init__(self, size: int, vocab_size: int, max_length: int, split: str = "train") -> None:
        if vocab_size <= FIRST_WORD + 1:
            raise ValueError(f"synthetic data needs model.vocab_size > {FIRST_WORD + 1}")
        offset = {"train": 0, "valid": 1, "test": 2}[split]
        rng = np.random.default_rng([12345, offset])
        lo, hi = 2, max(3, min(max_length - 1, 30))
        self.lengths_raw = rng.integers(lo, hi + 1, size=size)
        self.tokens = [rng.integers(FIRST_WORD, vocab_size, size=n) for n in self.lengths_raw]
        self.task = rng.integers(0, 2, size=size)
        self._words = np.concatenate([np.zeros(0, np.int64), *self.tokens])  # end to end
        self._starts = np.cumsum(self.lengths_raw) - self.lengths_raw
        self.vocab_size = vocab_size
        self.directions = ["copy-reverse"]

    def __len__(self) -> int:
        return len(self.tokens)

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(source ids with task token and EOS, target ids with EOS)."""
        words = self.tokens[i]
        src = np.concatenate([[COPY if self.task[i] == 0 else REVERSE], words, [EOS_ID]])
        tgt = np.concatenate([words if self.task[i] == 0 else words[::-1], [EOS_ID]])
        return src, tgt

    def sample_size(self, i: int) -> int:
        """Padded cost of sample i: the longer of source and target."""
        return int(self.lengths_raw[i]) + 2


def collate(data: SyntheticData, ids: list[int]) -> dict:
    """Right-padded batch dict of long tensors for sample ``ids`` of ``data``: each pair as
    :meth:`SyntheticData.pair` gives it, laid out by :func:`~megatron_branchnorm.data.dataset.
    pair_batch` (no loop over sentences)."""
    ids_arr = np.asarray(ids, dtype=np.int64)
    n = data.lengths_raw[ids_arr].astype(np.int64)
    reverse = data.task[ids_arr] != 0
    rows, cols = ragged_cells(n)
    first = data._starts[ids_arr][rows]
    words = data._words[first + cols]
    out_words = data._words[first + np.where(reverse[rows], n[rows] - 1 - cols, cols)]
    side = (rows, cols, n)
    tasks = np.where(reverse, REVERSE, COPY)  # each source's first token
    ids_t = torch.as_tensor(ids, dtype=torch.long)
    return pair_batch(tasks, (words, *side), (out_words, *side), ids_t)


class SyntheticBatches:
    """Length-bucketed token-based batches over SyntheticData, infinite and resumable.

    Epoch e: a permutation seeded by (seed, e), sorted by length inside windows of 64
    batches' worth of samples, cut into batches of at most ``max_tokens`` padded tokens,
    batch order shuffled. ``shuffle=False`` gives one pass in index order.
    """

    def __init__(self, data: SyntheticData, max_tokens: int, seed: int, shuffle: bool = True):
        self.data, self.max_tokens, self.seed, self.shuffle = data, max_tokens, seed, shuffle
        self.epoch, self.position = 0, 0
        self._plan: list[list[int]] | None = None

    def _make_plan(self, epoch: int) -> list[list[int]]:
        n = len(self.data)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = rng.permutation(n)
        else:
            order = np.arange(n)
        sizes = np.array([self.data.sample_size(i) for i in range(n)])
        window = 4096
        batches: list[list[int]] = []
        for w in range(0, n, window):
            chunk = order[w : w + window]
            chunk = chunk[np.argsort(sizes[chunk], kind="stable")]
            cur: list[int] = []
            longest = 0
            for i in chunk.tolist():
                longest_new = max(longest, sizes[i])
                if cur and longest_new * (len(cur) + 1) > self.max_tokens:
                    batches.append(cur)
                    cur, longest_new = [], sizes[i]
                cur.append(i)
                longest = longest_new
            if cur:
                batches.append(cur)
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch, 1])
            batches = [batches[k] for k in rng.permutation(len(batches))]
        return batches

    def epoch_plan(self, epoch: int, keep):
        """Epoch ``epoch`` as :meth:`megatron_branchnorm.data.BatchSampler.epoch_plan` gives
        it (the samples of the positions ``keep`` selects; group 0 is the only direction)."""
        from megatron_branchnorm.data.dataset import EpochPlan, id_fingerprints

        batches = [np.asarray(b, dtype=np.int64) for b in self._make_plan(epoch)]
        n = self.data.lengths_raw.astype(np.int64)
        positions = np.flatnonzero(keep(np.arange(len(batches))))
        return EpochPlan(
            epoch,
            ntokens=np.array([int((n[b] + 1).sum()) for b in batches], dtype=np.int64),
            src_ntokens=np.array([int((n[b] + 2).sum()) for b in batches], dtype=np.int64),
            samples=np.array([b.size for b in batches], dtype=np.int64),
            fingerprints=np.array(
                [id_fingerprints(b).sum(dtype=np.uint64) for b in batches], dtype=np.uint64
            ),
            mine={int(p): (0, batches[p]) for p in positions},
        )

    def collate(self, group: int, indices) -> dict:
        """The batch of samples ``indices`` (``group`` is always 0)."""
        return collate(self.data, [int(i) for i in indices])

    def __iter__(self):
        while True:
            if self._plan is None:
                self._plan = self._make_plan(self.epoch)
            while self.position < len(self._plan):
                ids = self._plan[self.position]
                self.position += 1
                yield collate(self.data, ids)
            if not self.shuffle:
                return
            self.epoch, self.position, self._plan = self.epoch + 1, 0, None

    def identity(self) -> dict:
        """Nothing to check a saved position against (the task is fixed by the config)."""
        return {}

    def check_state(self, state: dict) -> None:
        """Any saved position fits (see :meth:`identity`)."""

    def state_dict(self) -> dict:
        """Position in the stream (epoch, batch index)."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a saved position."""
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._plan = None
