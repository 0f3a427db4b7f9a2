"""Resume in another layout with the whole training state (docs/design.md §17).

Each case trains an uninterrupted reference to STEPS updates, saving at CUT; a copy of its save
directory holding only that checkpoint is resumed in another layout (stage count, data-parallel
size, or both) to STEPS through tests/pipeline/relayout_probe.py, which writes the state each
rank holds right after the resume. Then, per case:

- the state (fp32 master weights, both Adam moments, Adam's step) equals the checkpoint's per
  flat key, exactly, on every parameter of the model;
- the losses of updates CUT+1..STEPS equal the reference's within docs/design.md §5's
  tolerance for a changed reduction order (fp32: 1e-4 relative, the S-stages-vs-1 row; bf16:
  1e-3, the bf16 row); lr, alpha and the update's batches (ids_hash) exactly;
- the log says the state was re-laid, and nothing says the optimizer state starts afresh.

Micro-batches per update are kept: 2 replicas x 2 micro-batches resume as 1 x 4 and back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_branchnorm.config import load_config
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import checkpoint_state
from megatron_branchnorm.parallel.partition import (
    engine_param_to_flat_key,
    pipe_to_flat_key,
    spec_names,
)
from tests.faults.common import wait_all
from tests.pipeline.conftest import ROOT, copy_at_checkpoint, launch_ranks

pytestmark = pytest.mark.distributed

TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")
PROBE = str(ROOT / "tests" / "pipeline" / "relayout_probe.py")
CUT, STEPS = 3, 6
BF16 = ["train.deepspeed_config=ds_configs/zero1_bf16.json"]
BASE = [
    "model.dropout=0.0",
    "train.log_interval=1",
    "train.eval_interval=0",
    f"train.save_interval={CUT}",
    f"train.max_steps={STEPS}",
]
TOLERANCE = {"fp32": 1e-4, "bf16": 1e-3}

# name: (precision, reference (stages, dp, micro-batches), resumed (stages, dp))
CASES = {
    "stages_4_to_2": ("fp32", (4, 1, 2), (2, 1)),
    "stages_2_to_4": ("fp32", (2, 1, 2), (4, 1)),
    "stages_3_to_1": ("fp32", (3, 1, 2), (1, 1)),
    "dp_2_to_1_bf16": ("bf16", (1, 2, 2), (1, 1)),
    "dp_1_to_2_bf16": ("bf16", (1, 1, 4), (1, 2)),
    "both_2x2_to_3x1_bf16": ("bf16", (2, 2, 2), (3, 1)),
}


def _launch(out: Path, name: str, world: int, args: list[str]):
    log_dir = out / f"logs_{name}"
    log_dir.mkdir()
    return name, log_dir, launch_ranks(args, world, log_dir)


def _finish(started) -> None:
    for name, log_dir, procs in started:
        codes = wait_all(procs, timeout=600)
        if any(codes):
            logs = "".join(p.read_text()[-2500:] for p in sorted(log_dir.glob("rank*.log")))
            pytest.fail(f"{name}: ranks exited {codes}\n{logs}")


def _in_waves(out: Path, runs: list[tuple[str, int, list[str]]], ranks: int = 5) -> None:
    """Start runs together while they hold at most ``ranks`` processes (2 cores)."""
    wave, held = [], 0
    for name, world, args in runs:
        if wave and held + world > ranks:
            _finish(wave)
            wave, held = [], 0
        wave.append(_launch(out, name, world, args))
        held += world
    _finish(wave)


@pytest.fixture(scope="module")
def relayout(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("relayout")
    refs = []
    for name, (precision, (stages, dp, micro), _) in CASES.items():
        args = [TRAIN, "--config", "tiny_cpu", *BASE, f"pipeline.stages={stages}",
                f"train.micro_batches={micro}", f"train.save_dir={out / 'ref' / name}",
                *(BF16 if precision == "bf16" else [])]  # fmt: skip
        refs.append((f"ref_{name}", stages * dp, args))
    _in_waves(out, refs)
    resumes = []
    for name, (precision, (_, _, micro), (stages, dp)) in CASES.items():
        run = out / "resumed" / name
        copy_at_checkpoint(out / "ref" / name, run, CUT)
        args = [PROBE, str(out / "probe" / name), "--config", "tiny_cpu", *BASE,
                f"pipeline.stages={stages}", f"train.micro_batches={micro}",
                f"train.save_dir={run}", *(BF16 if precision == "bf16" else [])]  # fmt: skip
        resumes.append((f"resumed_{name}", stages * dp, args))
    _in_waves(out, resumes)
    return out


def _checkpoint_state(tag_dir: Path, precision: str) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's state per flat key, read from its files: the optimizer files, and in
    fp32 the layer files for the weights (an fp32 run's masters)."""
    names = spec_names(load_config("tiny_cpu").model)
    state = checkpoint_state.read_optimizer_state(
        tag_dir, lambda n: engine_param_to_flat_key(n, names)
    )
    assert state is not None
    if precision == "fp32":
        _, weights = checkpoint_state.read_checkpoint(tag_dir, pipe_to_flat_key)
        for key, value in weights.items():
            state[key]["master"] = value.flatten()
    return state


def _rows(run: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "loss" in r}


@pytest.mark.parametrize("case", list(CASES))
def test_state_is_carried_exactly(relayout, case):
    precision = CASES[case][0]
    saved = _checkpoint_state(relayout / "ref" / case / ckpt.tag_for(CUT), precision)
    live: dict[str, dict[str, torch.Tensor]] = {}
    ranks = sorted((relayout / "probe" / case).glob("rank*.pt"))
    assert len(ranks) == CASES[case][2][0] * CASES[case][2][1]
    for path in ranks:
        live.update(torch.load(path, weights_only=True))
    assert sorted(live) == sorted(saved)  # every parameter of the model, once or more
    for key, want in saved.items():
        for part in ("master", "exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(live[key][part], want[part]), (key, part)
    assert float(next(iter(live.values()))["step"]) == CUT  # Adam's step: the updates applied


@pytest.mark.parametrize("case", list(CASES))
def test_following_updates_match_the_uninterrupted_run(relayout, case):
    precision, (_, dp, micro), (_, new_dp) = CASES[case]
    ref, run = _rows(relayout / "ref" / case), _rows(relayout / "resumed" / case)
    assert sorted(run) == list(range(1, STEPS + 1))  # the resume appended CUT+1..STEPS once
    tol = TOLERANCE[precision]
    for step in range(CUT + 1, STEPS + 1):
        r, o = ref[step], run[step]
        for key in ("loss", "nll_loss"):
            assert abs(o[key] - r[key]) <= tol * abs(r[key]), (step, key, o[key], r[key])
        for key in ("lr", "alpha", "ids_hash", "samples"):
            assert o[key] == r[key], (step, key)
    log = "".join(p.read_text() for p in (relayout / f"logs_resumed_{case}").glob("rank*.log"))
    assert "re-laid per parameter" in log
    assert "start fresh" not in log and "afresh" not in log
    if new_dp != dp:  # the micro-batches per update were kept
        assert f"train.micro_batches {micro} -> {dp * micro // new_dp}" in log
