"""Validation covers every translation direction: a fixed sample of each
direction's dev split, the loss per direction and the X->en / en->X / all averages in
metrics.jsonl, the same figures at 1 rank, 2 data-parallel ranks and 2 stages (with a number of
micro-batches that is not a multiple of the data-parallel size), and equal to the flat model's
loss on each direction alone (docs/design.md §5: 1e-5 relative).

Before the change the validator kept the first 64 batches of a pass that goes one direction at a
time: only the first directions were validated, and the row had ``valid_loss`` alone."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from megatron_branchnorm.config import load_config
from megatron_branchnorm.data import TranslationData
from megatron_branchnorm.data.sampling import SAMPLING_FILE, temperature_probs
from megatron_branchnorm.formats.records import read_metrics
from megatron_branchnorm.model import build_model, label_smoothed_nll_loss
from megatron_branchnorm.parallel.pipeline import PipeLoss
from megatron_branchnorm.tokens import PAD_ID
from megatron_branchnorm.training.data import resolve_vocab
from megatron_branchnorm.training.validation import ValidSet, summarize
from tests.data.conftest import make_opus, run_preprocess
from tests.faults.common import wait_all
from tests.pipeline.conftest import ROOT, launch_ranks
from tests.pipeline.validation_harness import K, overrides

pytestmark = pytest.mark.distributed
RTOL = 1e-5  # docs/design.md §5: the same sentences batched differently (padding, sum order)
DIRECTIONS = ["de-en", "en-de", "en-es", "en-fr", "es-en", "fr-en"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """Three English-centric pairs (6 directions) of unequal size."""
    root = tmp_path_factory.mktemp("valid_corpus")
    make_opus(root / "raw", {"de": (80, 12, 4), "fr": (40, 10, 4), "es": (20, 9, 4)})
    run_preprocess(root / "raw", root / "data", ["de", "es", "fr"], max_len=64)
    return root / "data"


@pytest.fixture(scope="module")
def runs(corpus, tmp_path_factory) -> Path:
    """tests/pipeline/validation_harness.py on 1 rank, then on 2."""
    out = tmp_path_factory.mktemp("valid_runs")
    for world in (1, 2):
        logs = out / f"logs{world}"
        logs.mkdir()
        harness = [str(ROOT / "tests/pipeline/validation_harness.py"), str(corpus), str(out)]
        codes = wait_all(launch_ranks(harness, world, logs), timeout=300)
        if codes != [0] * world:
            text = "".join(p.read_text()[-2500:] for p in sorted(logs.glob("rank*.log")))
            pytest.fail(f"{world}-rank validation harness exited {codes}:\n{text}")
    return out


def _row(run: Path, step: int) -> dict:
    rows = [r for r in read_metrics(run, strict=True) if "valid_loss" in r and r["step"] == step]
    assert len(rows) == 1, rows
    return rows[0]


def _reference(corpus: Path, save_dir: Path) -> dict[str, float]:
    """Each direction's per-token loss (label-smoothed) of the flat model with the pipeline's
    initial weights, on that direction's first K usable dev sentences as one batch."""
    cfg = resolve_vocab(load_config("tiny_cpu", overrides(str(corpus), save_dir)))
    model = build_model(cfg.model, cfg.train.seed).eval()
    dev = TranslationData(str(corpus), "dev", cfg.data.max_length)
    out = {}
    with torch.no_grad():
        for g, name in enumerate(dev.directions):
            b = dev.collate(g, dev.group_indices(g)[:K])
            logits = model(b["src_tokens"], b["prev_output_tokens"])
            loss, _, ntok = label_smoothed_nll_loss(logits, b["target"], 0.1)
            out[name] = float(loss) / int(ntok)
    return out


def test_every_direction_is_validated_and_matches_the_flat_model(corpus, runs):
    row = _row(runs / "one", 0)
    per = row["valid_loss_by_direction"]
    assert sorted(per) == DIRECTIONS
    mean = sum(per.values()) / len(per)  # the macro average: each direction counts once
    assert row["valid_loss"] == pytest.approx(mean, rel=1e-12)
    x_en = [per[d] for d in DIRECTIONS if d.endswith("-en")]
    en_x = [per[d] for d in DIRECTIONS if d.startswith("en-")]
    assert row["valid_loss_x_en"] == pytest.approx(sum(x_en) / 3, rel=1e-12)
    assert row["valid_loss_en_x"] == pytest.approx(sum(en_x) / 3, rel=1e-12)
    ref = _reference(corpus, runs / "ref")
    for name in DIRECTIONS:
        assert per[name] == pytest.approx(ref[name], rel=RTOL), name
    # and the trainer's own validation row after an update, every direction again
    assert sorted(_row(runs / "one", 1)["valid_loss_by_direction"]) == DIRECTIONS


@pytest.mark.parametrize("run", ["dp2", "pp2"])
def test_two_ranks_give_the_one_rank_figures(runs, run):
    plan = json.loads((runs / "dp2" / "plan.json").read_text())
    assert sum(plan["counts"]) % 2 == 1  # padded: one replica runs a micro-batch of no tokens
    one, two = _row(runs / "one", 0), _row(runs / run, 0)
    assert two["valid_tokens"] == one["valid_tokens"]
    for key in ("valid_loss", "valid_nll_loss", "valid_loss_x_en", "valid_loss_en_x"):
        assert two[key] == pytest.approx(one[key], rel=RTOL), key
    for name in DIRECTIONS:
        got, want = two["valid_loss_by_direction"][name], one["valid_loss_by_direction"][name]
        assert got == pytest.approx(want, rel=RTOL), name


def test_sampling_table_in_the_run_dir(corpus, runs):
    lines = (runs / "one" / SAMPLING_FILE).read_text().splitlines()
    assert lines[0].split("\t") == ["direction", "pairs", "natural", "sampled"]
    rows = [line.split("\t") for line in lines[1:]]
    assert [r[0] for r in rows] == DIRECTIONS
    train = TranslationData(str(corpus), "train", 48)
    pairs = [int(r[1]) for r in rows]
    assert pairs == [train.group_indices(g).size for g in range(6)]
    assert sum(float(r[2]) for r in rows) == pytest.approx(1.0, abs=1e-6)
    sampled = [float(r[3]) for r in rows]
    assert sampled == pytest.approx(list(temperature_probs(pairs, 5.0)), abs=1e-8)


# --- pieces, without ranks -----------------------------------------------------------------


def test_summary_of_one_pseudo_direction_has_no_pivot_averages():
    row = summarize(["copy-reverse"], None, [[30.0, 20.0, 10.0]])
    assert row == {
        "valid_loss": 3.0,
        "valid_nll_loss": 2.0,
        "valid_loss_by_direction": {"copy-reverse": 3.0},
        "valid_tokens": 10,
    }


def test_summary_is_a_macro_average_and_skips_directions_without_tokens():
    sums = [[10.0, 9.0, 10.0], [300.0, 290.0, 100.0], [0.0, 0.0, 0.0]]
    row = summarize(["de-en", "en-de", "en-fr"], "en", sums)
    assert row["valid_loss"] == 2.0  # (1 + 3) / 2, not 310 / 110
    assert (row["valid_loss_x_en"], row["valid_loss_en_x"]) == (1.0, 3.0)
    assert "en-fr" not in row["valid_loss_by_direction"]
    assert summarize(["de-en"], "en", [[0.0, 0.0, 0.0]]) == {}


class _OneDirection:
    """A one-pass sampler stand-in: ``count`` batches whose target is ``count`` tokens."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.data = self

    def group_indices(self, group: int) -> np.ndarray:
        return np.arange(4)

    def collate(self, group: int, indices) -> dict:
        t = torch.full((1, 3), 7, dtype=torch.long)
        return {"src_tokens": t, "prev_output_tokens": t, "target": t, "ntokens": 3}

    def __iter__(self):
        for i in range(self.count):
            yield {"i": i}


def test_fewer_micro_batches_than_replicas_are_padded_without_tokens():
    valid = ValidSet(["a-en", "en-a"], "en", [_OneDirection(1), _OneDirection(2)], [1, 2], dp=4)
    assert valid.per_rank == 1
    assert [valid.direction_ids(d) for d in range(4)] == [[0], [1], [1], [0]]
    assert [b.get("i") for b in valid.collate(2)] == [1]
    padding = valid.collate(3)[0]
    assert bool((padding["target"] == PAD_ID).all()) and padding["ntokens"] == 0
    # the loss of a micro-batch without target tokens: 0, over 0 tokens
    loss_fn = PipeLoss(0.1)
    loss_fn.start_recording()
    loss_fn(torch.randn(1, 3, 11), torch.tensor([[5, 6, 3]]))
    loss_fn(torch.randn(1, 3, 11), padding["target"])
    rows = loss_fn.stop_recording()
    assert rows.shape == (2, 3) and rows[0, 2] == 3
    assert rows[1].tolist() == [0.0, 0.0, 0.0]
    assert loss_fn.stop_recording() is None and not math.isnan(float(loss_fn.sums()[0]))
