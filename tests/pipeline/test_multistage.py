"""Pipelines of 3 and 4 stages: middle stages, the layouts a user can write, the
flat-model parity and the 1-stage loss curve (docs/design.md §5 tolerances), activation
checkpointing on, and a 4-stage save + SIGUSR1 + exact resume.

Before the fix in pipeline.install_engine_fixes every run here crashed in its first update:
a middle stage received the float gradient of ``memory`` into the int64 buffer that had
held ``src_tokens`` (gloo: "Received data size doesn't match expected size", 2x).
"""

from __future__ import annotations

import json
import math
import re
import signal
import subprocess
import sys

import pytest

from megatron_branchnorm.experiments.fault_inject import FAULT_ENV
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.training.exit_codes import REQUEUE_EXIT_CODE
from tests.faults.common import (
    INJECTOR,
    assert_matches_reference,
    kill_hard_when,
    last_by_step,
    wait_all,
)
from tests.pipeline.conftest import ROOT, launch_ranks
from tests.pipeline.harness import SCHEMES, check_bucket_parity
from tests.pipeline.multistage import BASE, PARITY_LAYOUTS, RUNS, STEPS, run_overrides

TRAIN = str(ROOT / "megatron_branchnorm" / "train.py")
pytestmark = pytest.mark.distributed


def _fail(codes, log_dir, what: str) -> None:
    logs = "".join(p.read_text()[-2500:] for p in sorted(log_dir.glob("rank*.log")))
    pytest.fail(f"{what}: ranks exited {codes}\n{logs}")


@pytest.fixture(scope="session")
def multistage(tmp_path_factory):
    """The 3-rank and 4-rank harness launches, the one-process reference, and a 4-stage run
    stopped by SIGUSR1 to a middle stage and restarted to the end."""
    out = tmp_path_factory.mktemp("multistage")
    for world in (3, 4):
        log_dir = out / f"logs{world}"
        log_dir.mkdir()
        harness = [str(ROOT / "tests/pipeline/multistage_harness.py"), str(out)]
        procs = launch_ranks(harness, world, log_dir)
        codes = wait_all(procs, timeout=600)
        if codes != [0] * world:
            _fail(codes, log_dir, f"{world}-rank harness")
    one = subprocess.run(
        [sys.executable, TRAIN, "--config", "tiny_cpu", *BASE, f"train.save_dir={out / 'one'}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]

    # the reference run again, SIGUSR1 to rank 1 (a middle stage) after 5 updates, restarted
    run = out / "s4_usr1"
    args = [TRAIN, "--config", "tiny_cpu", *run_overrides("s4_resume_ref", out)]
    args = [a if not a.startswith("train.save_dir=") else f"train.save_dir={run}" for a in args]
    logs = out / "usr1_logs"
    logs.mkdir()
    slow = ["-m", INJECTOR, *args[1:]]  # train.py's main inside the test-only fault injector
    procs = launch_ranks(slow, 4, logs, env={FAULT_ENV: "slow@0.3"})
    _, codes = kill_hard_when(procs, run, 1, 5, timeout=300, sig=signal.SIGUSR1)
    usr1 = {"codes": codes, "logged": max(last_by_step(run), default=0)}
    usr1["tag"] = ckpt.resume_tag(run)[0]
    logs = out / "restart_logs"
    logs.mkdir()
    codes = wait_all(launch_ranks(args, 4, logs), timeout=300)
    if codes != [0] * 4:
        _fail(codes, logs, "4-stage restart after SIGUSR1")
    return out, usr1


@pytest.mark.parametrize(
    "world,layout",
    [(w, layout) for w, layouts in PARITY_LAYOUTS.items() for layout in layouts],
)
@pytest.mark.parametrize("scheme", SCHEMES)
def test_multistage_matches_flat_model(multistage, world, layout, scheme):
    """Same weights and batch: S-stage loss and gradients vs the flat model (checkpointing on)."""
    out, _ = multistage
    results = json.loads((out / f"multistage{world}.json").read_text())["parity"]
    r = results[f"{scheme}|{layout}"]
    assert abs(r["loss"] - r["ref_loss"]) <= 1e-6 * abs(r["ref_loss"])  # docs/design.md §5
    assert r["worst_rel_grad_err"] <= 1e-5  # docs/design.md §5: 1e-5 x the tensor's norm
    # every flat parameter got a gradient, the tied embedding once per stage that holds it
    assert r["embed_copies"] >= 2
    assert r["grad_params"] == r["flat_params"] + r["embed_copies"] - 1


@pytest.mark.parametrize(
    "world,layout",
    [(w, layout) for w, layouts in PARITY_LAYOUTS.items() for layout in layouts],
)
def test_multistage_with_buckets_matches_flat_model(multistage, world, layout):
    """Padded micro-batches of two fixed shapes (padding rows included), sent as fixed shapes
    through middle stages: the unpadded flat model's loss and gradients, and the shapes'
    metadata sent once per bucket (docs/design.md §18)."""
    out, _ = multistage
    results = json.loads((out / f"multistage{world}.json").read_text())["parity"]
    check_bucket_parity(results[f"buckets|{layout}"], world)


@pytest.mark.parametrize("name", ["s3_mixed", "s3_switch", "s4_layout", "s4_resume_ref"])
def test_multistage_matches_one_stage(multistage, name):
    """Dropout 0: S stages give the 1-stage loss curve over 10 updates (1e-4 relative, docs/design.md §5);
    the s4_resume_ref run has dropout 0.1, so it is compared only where dropout is not used."""
    out, _ = multistage
    got, want = last_by_step(out / name), last_by_step(out / "one")
    assert sorted(got) == sorted(want) == list(range(1, STEPS + 1))
    log = (out / f"logs{RUNS[name]['world']}" / "rank0.log").read_text()
    assert f"world {RUNS[name]['world']} = {RUNS[name]['world']} stages x 1" in log
    for s in got:
        for key in ("lr", "alpha", "ids_hash", "samples"):
            assert got[s][key] == want[s][key], (name, s, key)
        if "extra" in RUNS[name]:
            continue
        for key in ("loss", "nll_loss", "grad_norm"):
            assert got[s][key] == pytest.approx(want[s][key], rel=1e-4), (name, s, key)
    # token-based batches: the number of sentences per update (so the shapes) varies
    samples = [want[s]["samples"] for s in sorted(want)]
    sizes = {b - a for a, b in zip([0, *samples], samples, strict=False)}
    assert len(sizes) > 2, sizes


def test_four_stages_sigusr1_and_exact_resume(multistage):
    """SIGUSR1 to a middle stage: all 4 ranks checkpoint the last update and exit 75; the
    restart equals the uninterrupted 4-stage run (dropout on, saves every 4) exactly."""
    out, usr1 = multistage
    assert usr1["codes"] == [REQUEUE_EXIT_CODE] * 4, usr1
    assert usr1["tag"] == ckpt.tag_for(usr1["logged"]) and 5 <= usr1["logged"] < STEPS
    ckpt.verify_checkpoint(out / "s4_usr1" / usr1["tag"])
    assert_matches_reference(out / "s4_usr1", out / "s4_resume_ref", steps=STEPS)
    saved = sorted(p.name for p in (out / "s4_resume_ref").glob("global_step*"))
    assert saved == ["global_step10", "global_step4", "global_step8"]
    # validation through 4 stages, and the same validation losses after the resume
    ref, got = _valid(out / "s4_resume_ref"), _valid(out / "s4_usr1")
    assert sorted(ref) == [5, 10] and all(math.isfinite(v) for v in ref.values())
    assert got[10] == ref[10]


def test_middle_stages_build_no_batches(multistage):
    """Of 4 stages only the first and last build the epoch's plan (DeepSpeed loads
    micro-batches there only); the middle ones build nothing, and the restart resumed them."""
    out, _ = multistage
    for rank in range(4):
        log = (out / "restart_logs" / f"rank{rank}.log").read_text()
        if rank in (1, 2):
            assert f"rank {rank} (stage {rank}): data: this stage reads no batches" in log
        else:
            assert re.search(
                rf"rank {rank} \(stage {rank}\): data: epoch \d+ holds (\d+) batches, "
                r"this rank reads \1 \(data-parallel rank 0 of 1",
                log,
            ), log[-2000:]


def _valid(run) -> dict[int, float]:
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["valid_loss"] for r in rows if "valid_loss" in r}
