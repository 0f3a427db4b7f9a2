"""``make gpu-bench`` in its CPU small mode (experiments/gpu_bench.py).

The run is train.py's real Trainer (one stage, bf16 + ZeRO-1, in this process) beside the plain
loops at one tiny size: every system has its row, what ran has positive, finite figures, and
what cannot run here (torch.compile on the CPU, torchscale where it is not installed) says why
in one line. Times are not checked. The statistics behind the figures are checked on known
numbers.
"""

from __future__ import annotations

import json
import math
import signal

import pytest

from megatron_branchnorm.experiments import gpu_bench
from megatron_branchnorm.training.stop_signals import STOP_SIGNALS


def test_steady_state_is_the_median_of_the_last_half() -> None:
    warm_up_then_steady = [9.0, 7.0, 5.0, 1.0, 2.0, 3.0]
    assert gpu_bench.steady_state(warm_up_then_steady) == 2.0
    assert gpu_bench.steady_state([4.0, 6.0, 5.0]) == 5.5  # the last 2 of 3
    assert gpu_bench.steady_state([3.0]) == 3.0


def test_busy_time_is_the_union_of_the_kernels_intervals() -> None:
    overlapping = [(0.0, 2.0), (1.0, 3.0), (5.0, 6.0), (5.5, 5.8)]
    assert gpu_bench.union_seconds(overlapping) == 4.0
    assert gpu_bench.union_seconds([]) == 0.0


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--systems", "train.py,fairseq"], "--systems: unknown fairseq"),
        (["--tokens", "4096,lots"], "--tokens: expected integers"),
        (["--tokens", "8"], "--tokens: each must be at least 32"),
        (["--override", "model.dropout"], "--override: expected KEY=VALUE"),
        (["--updates", "1"], "--updates"),
    ],
)
def test_bad_flags_are_one_line(capsys, argv: list[str], needle: str) -> None:
    assert gpu_bench.main(["--device", "cpu", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and needle in err[0], err


@pytest.mark.distributed
def test_cpu_small_mode_prints_every_row(tmp_path, capsys) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (*STOP_SIGNALS, signal.SIGINT)}
    try:
        code = gpu_bench.main(
            ["--device", "cpu", "--tokens", "64", "--updates", "4",
             "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "rows.json")]
        )  # fmt: skip
    finally:
        for sig, handler in handlers.items():  # the Trainer installs its own
            signal.signal(sig, handler)
    out = capsys.readouterr().out
    assert code == 0, out
    table = [line for line in out.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| system | tokens per side | ms per update | tokens/s |")
    assert len(table) == 2 + len(gpu_bench.SYSTEMS)
    rows = {r["system"]: r for r in json.loads((tmp_path / "rows.json").read_text())["rows"]}
    assert set(rows) == set(gpu_bench.SYSTEMS)
    measured = ["train.py", "ours", "torch"]
    if rows["torchscale"]["tokens_per_s"] is not None:  # installed on this machine
        measured.append("torchscale")
    else:
        assert rows["torchscale"]["note"].startswith(("not installed", "not importable"))
    for name in measured:
        r = rows[name]
        for key in ("ms_per_update", "tokens_per_s", "flops_per_s", "busy", "peak_memory"):
            assert math.isfinite(r[key]) and r[key] > 0, (name, key, r)
        assert any(line.startswith(f"| {gpu_bench.LABELS[name]} | 64 | ") for line in table)
    assert rows["train.py"]["planned_memory"] > 0 and rows["train.py"]["data_ms"] > 0
    assert "host time per update in its data stream" in out
    ours = next(line for line in table if "train.py" in line)
    assert "planner:" in ours
    # the planner's time per update beside the measured one (planner.RunPlan.seconds_per_update)
    assert rows["train.py"]["planned_ms"] > 0
    r = rows["train.py"]
    settled = "" if r["settled"] else " (shapes not yet settled)"
    assert f"| {r['ms_per_update']:.1f} over {r['timed_updates']}{settled} (planner: " in ours
    assert 1 <= r["timed_updates"] <= 2  # of the last half of 4 updates
    assert f"train.py rows: data.bucket_shapes={gpu_bench.BUCKET_SHAPES}; " in out
    per_pair = rows["train.py"]["ms_per_update"] / rows["train.py"]["layers"]
    assert f"train.py at 64: {per_pair:.2f} ms of host time per encoder + decoder layer" in out
    assert "not run on the CPU" in rows["torch-compiled"]["note"]
    assert "bf16 matmul peak" in out and "train.py's tokens/s over: " in out


def test_no_system_starts_past_the_time_budget(tmp_path, capsys) -> None:
    """--max-minutes: a row that would start too late is left out with a note (here every
    row: half a minute leaves less than any system's reserve), and the table still prints."""
    argv = ["--device", "cpu", "--tokens", "64", "--max-minutes", "0.5",
            "--systems", "train.py,torch-compiled", "--workdir", str(tmp_path)]  # fmt: skip
    assert gpu_bench.main(argv) == 0
    out = capsys.readouterr().out
    rows = [
        line for line in out.splitlines() if line.startswith("| train.py") or "compile |" in line
    ]
    assert len(rows) == 2, out
    assert all("not run: the --max-minutes 0.5 are spent" in line for line in rows), out


def test_each_system_runs_at_every_size_before_the_next(tmp_path, monkeypatch) -> None:
    """RUN_ORDER system by system, each at both sizes: a time limit then cuts the anchors
    and the compile, not train.py at 16,384 tokens (the 35% goal). The runs are stood in."""
    ran = []

    def stand_in(system, n):
        ran.append((system, n))
        return gpu_bench.Result(system, n, note="stood in")

    monkeypatch.setattr(
        gpu_bench, "run_train_py", lambda shape, n, u, d, w, e, system: stand_in(system, n)
    )
    monkeypatch.setattr(gpu_bench, "run_loop", lambda system, shape, n, u, d: stand_in(system, n))
    monkeypatch.setattr(gpu_bench, "loop_skip_reason", lambda system, device: None)
    gpu_bench.run_bench("cpu", (64, 128), 2, ("torch", "train.py", "torchscale"), tmp_path, [])
    assert ran == [("train.py", 64), ("train.py", 128), ("torchscale", 64), ("torchscale", 128),
                   ("torch", 64), ("torch", 128)]  # fmt: skip


def test_the_table_says_what_the_runs_make_of_the_planners_rates() -> None:
    """Below the table, each train.py row's implied planner rate: eagerly the host's ms per
    layer pair (the update's time over its layers), with graphs the GPU's sustained TFLOP/s
    (the planner's GPU FLOPs of the update over its time): the figures a first GPU run
    sets planner.EAGER_HOST_S and --tflops by."""
    common = dict(tokens=4096, tokens_per_s=1e5, flops_per_s=1e13, busy=0.5, layers=12,
                  planned_flops=2.0e12)  # fmt: skip
    rows = [
        gpu_bench.Result("train.py", ms_per_update=108.0, planned_ms=108.4, **common),
        gpu_bench.Result("train.py+graphs", ms_per_update=20.0, planned_ms=20.0, **common),
    ]
    text = gpu_bench.format_table(gpu_bench.Bench([], 7.75e14, rows), "cuda")
    assert "| 108.0 (planner: 108.4) |" in text and "| 20.0 (planner: 20.0) |" in text
    assert "train.py at 4,096: 9.00 ms of host time per encoder + decoder layer pair" in text
    assert "(planner: 9.03 ms)" in text
    assert "train.py+graphs at 4,096: 100.0 TFLOP/s of matmuls (padding counted)" in text


def test_a_train_py_run_that_fails_is_its_rows_note_and_exit_1(tmp_path, capsys, monkeypatch):
    """A train.py run that raises (a capture the GPU refuses, out of memory) becomes its row's
    one-line note; the other systems still run, the table still prints, the exit status is 1."""

    def refused(*_args, **_kwargs):
        raise RuntimeError("operation not permitted when stream is capturing\nline two")

    monkeypatch.setattr(gpu_bench, "run_train_py", refused)
    argv = ["--device", "cpu", "--tokens", "64", "--updates", "2", "--systems", "train.py,ours",
            "--workdir", str(tmp_path)]  # fmt: skip
    assert gpu_bench.main(argv) == 1
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert table[2] == (
        f"| {gpu_bench.LABELS['train.py']} | 64 | failed: RuntimeError: operation not permitted "
        "when stream is capturing line two (see the log) | | | | |"
    )
    assert table[3].startswith(f"| {gpu_bench.LABELS['ours']} | 64 | ")
    assert "Traceback" in (tmp_path / "gpu_bench.log").read_text()  # the whole story, logged


def test_the_timed_updates_are_replays_of_shapes_captured_before() -> None:
    """With graphs, a shape's first WARMUP calls run eagerly and the next captures: only an
    update of the last half whose every shape has run more than WARMUP times is a replay."""
    a, b, c = (1,), (2,), (3,)
    shapes = [(a,), (b,), (a,), (a,), (b,), (a,), (c,), (b,), (b,), (a,)]
    # last half: indices 5-9; a's calls before 5: 3, c new at 6, b's before 7: 2, before 8: 3
    assert gpu_bench.steady_updates(shapes, 10, warmup=2) == [5, 8, 9]
    assert gpu_bench.steady_updates(shapes, 10, warmup=0) == [5, 7, 8, 9]
    assert gpu_bench.steady_updates([(), (), (), ()], 4, warmup=2) == [2, 3]  # no buckets


def test_the_train_rows_pin_their_bucket_shapes_unless_overridden(tmp_path) -> None:
    shape = gpu_bench.CPU_SHAPE
    base = gpu_bench.train_overrides(shape, 64, 4, tmp_path, [])
    assert f"data.bucket_shapes={gpu_bench.BUCKET_SHAPES}" in base
    mine = gpu_bench.train_overrides(shape, 64, 4, tmp_path, ["data.bucket_shapes=2"])
    assert mine[-1] == "data.bucket_shapes=2"  # the override comes last: it wins
    assert gpu_bench._bucket_shapes(["data.bucket_shapes=2"]) == "2"
    assert gpu_bench._bucket_shapes([]) == str(gpu_bench.BUCKET_SHAPES)
