"""Long fault-injection runs behind docs/reliability.md (the CI-sized suite is tests/faults).

    python tools/fault_sweep.py --out runs/faults kill-points   # every save point x rank
    python tools/fault_sweep.py --out runs/faults corruption    # every file x every damage
    python tools/fault_sweep.py --out runs/faults soak --preemptions 10 --hard-kills 2
    python tools/fault_sweep.py --out runs/faults hang          # SIGSTOP a rank: timeout bound

Each mode starts 2 gloo ranks of train.py (fault_runs.py's BASE config: tiny 2-2 BranchNorm,
dropout 0.1, activation checkpointing, 2 stages), or with ``--world 4`` 4 ranks (2 stages x 2
data-parallel replicas; kill-points, soak), compares against one uninterrupted reference run on
as many ranks, prints a table and writes OUT/<mode>.json (OUT/<mode>_w4.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from megatron_branchnorm.cli import run_main
from megatron_branchnorm.experiments.fault_inject import SAVE_POINTS
from megatron_branchnorm.experiments.fault_runs import (
    kill_hard_when,
    last_by_step,
    launch,
    max_difference,
    param_hash,
    records,
)
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.outputs import claim_output_dir
from megatron_branchnorm.runner.ranks import wait_ranks


def reference(out: Path, steps: int, world: int = 2) -> Path:
    """The uninterrupted run on ``world`` ranks (reused when present)."""
    ref = out / ("reference" if world == 2 else f"reference_w{world}")
    if not (ref / ckpt.tag_for(steps) / ckpt.MANIFEST).is_file():
        shutil.rmtree(ref, ignore_errors=True)
        over = [f"train.max_steps={steps}", "train.save_interval=0"]
        codes = wait_ranks(launch(ref, over, ref, world=world))
        if codes != [0] * world:
            sys.exit(f"reference run failed: {codes}")
    return ref


def compare(run: Path, ref: Path, steps: int) -> dict:
    """Per-field max difference over all steps, final-weights equality, steps present."""
    got = last_by_step(run)
    missing = [s for s in range(1, steps + 1) if s not in got]
    diff = max_difference(run, ref, range(1, steps + 1)) if not missing else {}
    tag = ckpt.tag_for(steps)
    same = (run / tag).is_dir() and param_hash(run / tag) == param_hash(ref / tag)
    return {"missing_steps": missing, "max_diff": diff, "final_params_equal": same}


def kill_points(out: Path, steps: int, world: int = 2) -> list[dict]:
    """Cut the save at step 4 (checkpoints every 2) at each point on each rank; check which
    checkpoint a restart takes; restart to the end and compare with the reference."""
    ref = reference(out, steps, world)
    rows = []
    dp = world // 2  # BASE has 2 stages; rank = stage * dp + replica
    for point in SAVE_POINTS:
        for rank in range(world):
            if point in ("after_config", "after_manifest") and rank != 0:
                continue  # rank 0 alone writes these
            if point == "engine_file" and rank % dp:
                continue  # DeepSpeed writes a stage's files from its first replica only
            run = out / f"kill_points{'' if world == 2 else f'_w{world}'}" / f"{point}_rank{rank}"
            shutil.rmtree(run, ignore_errors=True)
            t0 = time.time()
            over = [f"train.max_steps={steps}", "train.save_interval=2"]
            fault = f"save_exit@{point}:rank{rank}:step4"
            codes = wait_ranks(launch(run, over, run, fault=fault, world=world))
            seconds = time.time() - t0
            tag = ckpt.resume_tag(run)[0]
            t0 = time.time()
            restart_codes = wait_ranks(launch(run, over, run, world=world))
            row = {
                "point": point,
                "rank": rank,
                "exit_codes": codes,
                "run_seconds": round(seconds, 1),
                "resumed_from": tag,
                # only a save cut after its manifest is complete (and newer than latest)
                "expected": ckpt.tag_for(4 if point == "after_manifest" else 2),
                "restart_codes": restart_codes,
                "restart_seconds": round(time.time() - t0, 1),
                **compare(run, ref, steps),
            }
            row["matches_reference"] = (
                restart_codes == [0] * world
                and not row["missing_steps"]
                and not any(row["max_diff"].values())
                and row["final_params_equal"]
            )
            rows.append(row)
            print(row, flush=True)
    print("| point | rank | exit codes | loaded | expected | restart matches reference | s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['point']} | {r['rank']} | {r['exit_codes']} | {r['resumed_from']} | "
            f"{r['expected']} | {r['matches_reference']} | "
            f"{r['run_seconds']} + {r['restart_seconds']} |"
        )
    return rows


def corruption(out: Path, steps: int) -> list[dict]:
    """Every file of the last checkpoint (and latest) x truncate / bit flip / zero / delete."""
    ref = reference(out, steps)
    tag = ckpt.tag_for(steps)
    damages = {
        "truncate": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
        "bitflip": lambda p: p.write_bytes(_flip(p.read_bytes())),
        "zero": lambda p: p.write_bytes(bytes(p.stat().st_size)),
        "delete": lambda p: p.unlink(),
    }
    rows = []
    names = sorted(p.name for p in (ref / tag).iterdir()) + ["../latest"]
    for name in names:
        for damage, fn in damages.items():
            work = out / "corruption" / "work"
            shutil.rmtree(work, ignore_errors=True)
            shutil.copytree(ref, work)
            fn((work / tag / name).resolve())
            try:
                t = ckpt.resume_tag(work)[0]
                ckpt.verify_checkpoint(work / t)
                outcome, named = "LOADED", False
            except ckpt.CheckpointError as exc:
                outcome, named = str(exc), Path(name).name in str(exc) or "checksums" in str(exc)
            rows.append({"file": name, "damage": damage, "error": outcome, "names_file": named})
    shutil.rmtree(out / "corruption" / "work", ignore_errors=True)
    caught = sum(r["error"] != "LOADED" for r in rows)
    print(f"corruption: {caught}/{len(rows)} refused, {sum(r['names_file'] for r in rows)} named")
    return rows


def _flip(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 3] ^= 0x10
    return bytes(b)


def soak(out: Path, steps: int, preemptions: int, hard_kills: int, world: int = 2) -> dict:
    """One run interrupted ``preemptions`` times by SIGUSR1/SIGTERM (to one rank or all) and
    ``hard_kills`` times by SIGKILL of one rank, each relaunch resuming; then compared."""
    ref = reference(out, steps, world)
    run = out / ("soak" if world == 2 else f"soak_w{world}")
    shutil.rmtree(run, ignore_errors=True)
    over = [f"train.max_steps={steps}", "train.save_interval=3"]
    events = ["usr1_all", "usr1_one", "term_one", "term_all"] * preemptions
    plan = events[:preemptions] + ["kill9"] * hard_kills
    plan = [plan[i] for i in sorted(range(len(plan)), key=lambda i: (i * 7) % len(plan))]
    log, lost = [], 0
    for k, event in enumerate(plan):
        before = len(last_by_step(run))
        procs = launch(run, over, run / "logs", fault="slow@0.2", world=world)
        victim = (k * 3) % world  # 2 ranks: 0, 1, 0, ...; 4 ranks: 0, 3, 2, 1, ...
        if event == "kill9":
            seconds, codes = kill_hard_when(procs, run, victim, min_rows=len(records(run)) + 2)
        else:
            deadline = time.time() + 240
            start_rows = len(records(run))
            while len(records(run)) < start_rows + 2 and time.time() < deadline:
                time.sleep(0.05)
            sig = signal.SIGUSR1 if event.startswith("usr1") else signal.SIGTERM
            targets = procs if event.endswith("all") else [procs[victim]]
            t0 = time.time()
            for p in targets:
                os.kill(p.pid, sig)
            codes = wait_ranks(procs, timeout=240)
            seconds = time.time() - t0
        latest = ckpt.resume_tag(run)[0]
        saved = ckpt.tag_step(latest) if latest else 0
        done = max(last_by_step(run), default=0)
        lost += done - saved  # updates redone after the restart
        log.append(
            {
                "event": event,
                "codes": codes,
                "exit_s": round(seconds, 2),
                "steps_lost": done - saved,
            }
        )
        print(log[-1], before, flush=True)
    codes = wait_ranks(launch(run, over, run / "logs", world=world))
    result = {"events": log, "final_codes": codes, "steps_redone": lost, **compare(run, ref, steps)}
    ids = [r["ids_hash"] for _, r in sorted(last_by_step(run).items())]
    ref_ids = [r["ids_hash"] for _, r in sorted(last_by_step(ref).items())]
    result["ids_hash_mismatches"] = sum(a != b for a, b in zip(ids, ref_ids, strict=False))
    return result


def hang(out: Path, timeout_s: float) -> dict:
    """SIGSTOP one rank (alive, not answering): the other must fail after the collective
    timeout (train.collective_timeout_s)."""
    run = out / "hang"
    shutil.rmtree(run, ignore_errors=True)
    procs = launch(
        run,
        [
            "train.max_steps=100000",
            "train.save_interval=0",
            f"train.collective_timeout_s={timeout_s}",
        ],
        run,
        fault="slow@0.2",
    )
    while len(records(run)) < 3:
        time.sleep(0.05)
    os.kill(procs[1].pid, signal.SIGSTOP)
    t0 = time.time()
    try:
        code = procs[0].wait(timeout=timeout_s * 4 + 120)
    finally:
        os.kill(procs[1].pid, signal.SIGKILL)
    return {"timeout_s": timeout_s, "survivor_exit_s": round(time.time() - t0, 1), "code": code}


def main(argv: list[str] | None = None) -> int:
    """Parse, run one mode, write OUT/<mode>.json. A refused --out (checked before any run
    starts) is one line ``error: ...`` and exit 2."""
    return run_main(_main, argv)


def _main(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=["kill-points", "corruption", "soak", "hang"])
    parser.add_argument("--out", type=Path, default=Path("runs/faults"))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--preemptions", type=int, default=10)
    parser.add_argument("--hard-kills", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=30.0, help="hang: collective timeout")
    parser.add_argument(
        "--world", type=int, choices=[2, 4], default=2, help="ranks (kill-points, soak)"
    )
    args = parser.parse_args(argv)
    modes = ("kill-points", "corruption", "soak", "hang")
    parts = ("reference", "kill_points", "corruption", "soak", "hang", "MODE.json")
    # it replaces these on reruns: never a user's directory (an OutputError, one line)
    legacy = tuple(f"{m}{w}.json" for m in modes for w in ("", "_w4"))
    claim_output_dir(args.out, "fault_sweep", "fault_sweep", parts, legacy)
    if args.mode == "kill-points":
        result = kill_points(args.out, args.steps, args.world)
    elif args.mode == "corruption":
        result = corruption(args.out, args.steps)
    elif args.mode == "soak":
        result = soak(args.out, max(args.steps, 40), args.preemptions, args.hard_kills, args.world)
    else:
        result = hang(args.out, args.timeout)
    name = args.mode if args.world == 2 else f"{args.mode}_w{args.world}"
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps(result, indent=1, default=str)[-3000:])
    return 0


if __name__ == "__main__":
    sys.exit(main())
