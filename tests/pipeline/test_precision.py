"""The GPU configs' precisions through the real engine on CPU ranks.

bf16 + ZeRO-1 (``ds_configs/zero1_bf16.json``: DeepSpeed's BF16 optimizer, fp32 master
weights and moments, fp32 gradient accumulation) runs natively on DeepSpeed's CPU
accelerator: 2 and 4 stages against 1 stage, and an exact resume.

fp16 cannot run on a CPU without fp16 kernels: there train.py refuses it with one line. The
fp16 engine path (DeepSpeed's ZeRO-1 optimizer with dynamic loss scaling) runs here through
the test-only emulation ``MBN_TEST_FP16_ON_CPU=1`` of the fault injector, which these runs
launch instead of train.py (experiments/fault_inject.py, FP16_ON_CPU_ENV; what it proves and
what it does not: docs/design.md §7).

Tolerance, bf16 S stages vs 1 stage, per step: 1e-3 relative. Both compute every micro-batch
with the same bf16 kernels; they differ in where the tied embedding's two gradient
contributions meet (in bf16 inside one backward on 1 stage, in fp32 across stages), an error
of bf16's unit roundoff (2^-8) on that gradient, which Adam passes on as at most that share
of an update: measured 3.4e-5 over 8 updates. 1e-3 is a quarter of bf16's resolution of the
loss; the same model in fp32 is 5e-3 away by step 8, which the test also checks, so the
tolerance separates bf16 from fp32.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_branchnorm.experiments.fault_inject import FP16_ON_CPU_ENV
from megatron_branchnorm.inference.convert import (
    load_pipeline_checkpoint,
    read_checkpoint,
    repartition_checkpoint,
)
from tests.faults.common import INJECTOR, wait_all
from tests.pipeline.conftest import ROOT, copy_at_checkpoint, launch_ranks

TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")
pytestmark = pytest.mark.distributed

BF16_TOL = 1e-3
STEPS = 8
BASE = [
    "model.dropout=0.0",
    "train.micro_batches=4",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=0",
    "pipeline.activation_checkpoint_interval=1",
]
FP16_JSON = {
    "zero_optimization": {"stage": 1, "reduce_bucket_size": 50000000},
    # 2^30: the first updates overflow; hysteresis 1: every overflow halves the scale
    "fp16": {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 30,
        "loss_scale_window": 1000,
        "hysteresis": 1,
        "min_loss_scale": 1,
    },
}


def _start(out: Path, name: str, stages: int, *extra: str, env: dict | None = None):
    """``stages`` ranks of tiny_cpu (1 stage: one plain process) saving in out/name; train.py,
    or with the fp16 emulation asked for in ``env`` train.py's main inside the injector."""
    log_dir = out / f"logs_{name}"
    log_dir.mkdir(exist_ok=True)
    emulated = (env or {}).get(FP16_ON_CPU_ENV) == "1"
    args = [
        *(["-m", INJECTOR] if emulated else [TRAIN]),
        "--config",
        "tiny_cpu",
        *BASE,
        f"pipeline.stages={stages}",
        f"train.save_dir={out / name}",
        *extra,
    ]
    return name, log_dir, launch_ranks(args, stages, log_dir, env=env)


def _finish(*started) -> None:
    for name, log_dir, procs in started:
        codes = wait_all(procs, timeout=600)
        if any(c != 0 for c in codes):
            logs = "".join(p.read_text()[-2500:] for p in sorted(log_dir.glob("rank*.log")))
            pytest.fail(f"{name}: ranks exited {codes}\n{logs}")


def _rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _optimizer_state(path: Path) -> dict:
    """A DeepSpeed optimizer file's state, unpickled with only the three DeepSpeed types
    these files hold allowed (weights_only=True)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    with torch.serialization.safe_globals([DynamicLossScaler, ZeroStageEnum, fragment_address]):
        saved = torch.load(path, map_location="cpu", weights_only=True)
    return saved["optimizer_state_dict"]


def _updates(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in _rows(run) if "loss" in r}


@pytest.fixture(scope="module")
def bf16(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bf16")
    ds = ["train.deepspeed_config=ds_configs/zero1_bf16.json"]
    _finish(_start(out, "s4", 4, f"train.max_steps={STEPS}", *ds))
    _finish(
        _start(out, "s1", 1, f"train.max_steps={STEPS}", *ds),
        _start(out, "fp32", 1, f"train.max_steps={STEPS}"),
        _start(out, "s2_split", 2, f"train.max_steps={STEPS // 2}", *ds),
    )
    _finish(
        _start(out, "s2", 2, f"train.max_steps={STEPS}", *ds),
        _start(out, "s2_split", 2, f"train.max_steps={STEPS}", *ds),  # resumes
    )
    repartition_checkpoint(out / "s2", out / "rep1", 1)
    _finish(_start(out, "rep1", 1, f"train.max_steps={STEPS + 1}", *ds))  # resumes, 1 stage
    return out


@pytest.mark.parametrize("stages", [2, 4])
def test_bf16_pipeline_equals_one_stage(bf16, stages):
    ref, run = _updates(bf16 / "s1"), _updates(bf16 / f"s{stages}")
    assert sorted(run) == sorted(ref) == list(range(1, STEPS + 1))
    for step, r in ref.items():
        o = run[step]
        assert abs(o["loss"] - r["loss"]) <= BF16_TOL * abs(r["loss"]), (step, o, r)
        assert o["lr"] == r["lr"] and o["alpha"] == r["alpha"]
        assert o["loss_scale"] == 1.0 and o["skipped_steps"] == 0


def test_bf16_is_not_fp32(bf16):
    """The tolerance resolves the precision: the same run in fp32 leaves it by step 8."""
    bf, f32 = _updates(bf16 / "s1"), _updates(bf16 / "fp32")
    worst = max(abs(bf[s]["loss"] - f32[s]["loss"]) / f32[s]["loss"] for s in f32)
    assert worst > 2 * BF16_TOL, worst


def test_bf16_resume_is_exact(bf16):
    """DeepSpeed's BF16 optimizer state (fp32 master weights, Adam moments) round-trips."""
    full, split = _updates(bf16 / "s2"), _rows(bf16 / "s2_split")
    steps = [r["step"] for r in split if "loss" in r]
    assert steps == list(range(1, STEPS + 1))  # each once: the resume appended
    for r in split:
        if "loss" in r:
            for key in ("loss", "nll_loss", "lr", "alpha", "grad_norm"):
                assert r[key] == full[r["step"]][key], (r["step"], key)


def test_bf16_export_holds_the_fp32_master_weights(bf16):
    """A bf16 checkpoint's layer files hold bf16 weights; the export takes DeepSpeed's fp32
    master weights from the BF16 optimizer's files instead."""
    model, meta = load_pipeline_checkpoint(bf16 / "s2")
    assert meta["weights"].startswith("fp32 master weights")
    exported = model.state_dict()
    _, layers = read_checkpoint(bf16 / "s2" / f"global_step{STEPS}")
    rounded = 0
    for key, value in exported.items():
        assert value.dtype == torch.float32
        # within bf16's rounding of the layer files' copy (unit roundoff 2^-8)...
        assert (value - layers[key]).abs().max() <= 2**-8 * value.abs().max() + 1e-12, key
        rounded += torch.equal(value, value.bfloat16().float())
    assert rounded == 0  # ...but none of them is a bf16 value: not the layer files
    # read independently: the embedding in stage 0's optimizer file
    path = bf16 / "s2" / f"global_step{STEPS}" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"
    opt = _optimizer_state(path)
    where = opt["param_slice_mappings"][0]["tied_modules.embed.embedding.weight"]
    flat = opt["single_partition_of_fp32_groups"][0][where.start : where.start + where.numel]
    assert torch.equal(flat.view_as(exported["embedding.weight"]), exported["embedding.weight"])


def test_bf16_checkpoint_repartitions_with_its_master_weights(bf16):
    original, _ = load_pipeline_checkpoint(bf16 / "s2")
    relaid, meta = load_pipeline_checkpoint(bf16 / "rep1", tag=f"global_step{STEPS}")
    assert meta["pipeline_stages"] == 1
    for key, value in original.state_dict().items():
        assert torch.equal(value, relaid.state_dict()[key]), key
    # and a 1-stage bf16 run resumed it layer by layer
    log = (bf16 / "logs_rep1" / "rank0.log").read_text()
    assert "weights loaded layer by layer" in log
    assert [r["step"] for r in _updates(bf16 / "rep1").values()] == [STEPS + 1]


# ---- fp16 --------------------------------------------------------------------------------


@pytest.mark.skipif(
    torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    reason="this CPU has fp16 kernels: DeepSpeed's CPU accelerator runs fp16 here",
)
def test_fp16_where_it_cannot_run_is_one_line_on_every_rank(tmp_path):
    name, log_dir, procs = _start(
        tmp_path,
        "fp16",
        2,
        "train.max_steps=1",
        "train.deepspeed_config=ds_configs/zero1_fp16.json",
        env={FP16_ON_CPU_ENV: "0"},
    )
    assert wait_all(procs, timeout=300) == [2, 2]
    for rank in (0, 1):
        lines = [
            line
            for line in (log_dir / f"rank{rank}.log").read_text().splitlines()
            if line.startswith("error:")
        ]
        assert len(lines) == 1, lines
        assert "ds_configs/zero1_fp16.json: fp16.enabled is true" in lines[0]
        assert "cannot run fp16; use ds_configs/cpu_fp32.json" in lines[0]
        assert "Traceback" not in (log_dir / f"rank{rank}.log").read_text()


@pytest.fixture(scope="module")
def fp16(tmp_path_factory) -> Path:
    """``full``: 4 updates, saving every 2; ``split``: a copy of ``full`` as it was at its
    checkpoint of update 2, resumed to 4; ``fp32``: update 1 in fp32, beside ``full``."""
    out = tmp_path_factory.mktemp("fp16")
    ds_json = out / "fp16_overflow.json"
    ds_json.write_text(json.dumps(FP16_JSON))
    env = {FP16_ON_CPU_ENV: "1"}
    run = ["train.max_steps=4", "train.save_interval=2", f"train.deepspeed_config={ds_json}"]
    _finish(
        _start(out, "full", 2, *run, env=env),
        _start(out, "fp32", 1, "train.max_steps=1"),
    )
    copy_at_checkpoint(out / "full", out / "split", 2)
    _finish(_start(out, "split", 2, *run, env=env))  # resumes
    return out


def test_fp16_overflow_skips_lower_the_scale_and_advance_nothing(fp16):
    rows = _rows(fp16 / "full")
    all_skips = [r for r in rows if r.get("skipped")]
    first = next(i for i, r in enumerate(rows) if "loss" in r)
    skips, later = rows[:first], [r for r in rows[first:] if r.get("skipped")]
    applied = [r for r in rows if "loss" in r]
    # every overflow halves the scale (hysteresis 1), starting from 2^30: first the run of
    # skips that finds a scale fp16 can hold, none of which advances the step
    assert len(skips) >= 3 and all(r.get("skipped") for r in skips)
    assert [r["loss_scale"] for r in all_skips] == [2.0 ** (29 - i) for i in range(len(all_skips))]
    assert all(r["step"] == 0 and r["update"] == 1 for r in skips)  # no step advanced
    assert [r["skipped_steps"] for r in all_skips] == list(range(1, len(all_skips) + 1))
    # a later overflow (the data's, at the lowered scale) skips its update too: the step
    # stays at the last applied one and the update is the next one
    for r in later:
        before = [a for a in applied if a["step"] <= r["step"]]
        assert before and r["step"] == before[-1]["step"] and r["update"] == r["step"] + 1
    # the applied updates count from 1 with the scale the skips left
    assert [r["step"] for r in applied] == [1, 2, 3, 4]
    assert applied[0]["loss_scale"] == skips[-1]["loss_scale"]
    assert applied[-1]["skipped_steps"] == len(all_skips)
    # LR schedule and BranchNorm's t were not advanced by the skips: update 1's values
    fp32 = _updates(fp16 / "fp32")[1]
    assert applied[0]["lr"] == fp32["lr"] and applied[0]["alpha"] == fp32["alpha"]
    # every stage applied exactly the 4 updates (its Adam step count), none of the skips,
    # and saved the lowered scale
    tag = (fp16 / "full" / "latest").read_text()
    for stage in (0, 1):
        path = fp16 / "full" / tag / f"zero_pp_rank_0_mp_rank_{stage:02d}_optim_states.pt"
        state = _optimizer_state(path)
        assert {int(s["step"]) for s in state["base_optimizer_state"]["state"].values()} == {4}
        assert state["loss_scaler"].cur_scale == applied[-1]["loss_scale"]


def test_fp16_loss_scale_survives_a_resume(fp16):
    full, split = _updates(fp16 / "full"), _rows(fp16 / "split")
    resumed = [r for r in split if "loss" in r and r["step"] > 2]
    skips_after_resume = [r for r in split if r.get("skipped") and r["step"] >= 2]
    full_skips = [r for r in _rows(fp16 / "full") if r.get("skipped") and r["step"] >= 2]
    # the scale was not reset to 2^30: after the resume the run skips exactly where the
    # uninterrupted one did (a later overflow of the data), at the same scale
    assert [(r["step"], r["loss_scale"]) for r in skips_after_resume] == [
        (r["step"], r["loss_scale"]) for r in full_skips
    ]
    assert [r["step"] for r in resumed] == [3, 4]
    for r in resumed:
        for key in ("loss", "nll_loss", "lr", "alpha", "grad_norm", "loss_scale"):
            assert r[key] == full[r["step"]][key], (r["step"], key)


def test_fp16_emulation_is_test_only():
    """The working code never emulates: with the variable set, train.py and the trainer leave
    the CPU accelerator's own answer; only the fault injector changes it."""
    code = (
        "import os; os.environ['MBN_TEST_FP16_ON_CPU'] = '1'\n"
        "import megatron_branchnorm.train, megatron_branchnorm.training.trainer\n"
        "from deepspeed.accelerator import get_accelerator\n"
        "import torch\n"
        "before = get_accelerator().is_fp16_supported()\n"
        "assert bool(before) == torch.ops.mkldnn._is_mkldnn_fp16_supported()\n"
        "from megatron_branchnorm.experiments.fault_inject import emulate_fp16_on_cpu\n"
        "assert emulate_fp16_on_cpu() and get_accelerator().is_fp16_supported()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-1500:]
