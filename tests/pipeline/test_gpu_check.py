"""tools/gpu_check.py on the CPU (workflows/gpu_check.py): the same checks as on a
GPU, in small sizes, with fp16 through the test-only emulation (experiments/fault_inject.py),
applied before gpu_check's main runs."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_branchnorm.workflows import gpu_check
from tests.pipeline.conftest import ROOT

pytestmark = pytest.mark.distributed


EMULATED_GPU_CHECK = (
    "import contextlib, sys\n"
    "from megatron_branchnorm.experiments.fault_inject import emulate_fp16_on_cpu\n"
    "with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed's import-time log lines\n"
    "    emulate_fp16_on_cpu()\n"
    "from megatron_branchnorm.workflows.gpu_check import main\n"
    "raise SystemExit(main())\n"
)
"""tools/gpu_check.py with DeepSpeed's CPU accelerator reporting fp16 as supported."""


def test_gpu_check_on_cpu_prints_one_passing_table(tmp_path):
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", EMULATED_GPU_CHECK, "--device", "cpu",
         "--ranks", "2", "--steps", "2", "--workdir", str(tmp_path / "work")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert table[0] == "| check | value | limit | verdict |"
    assert len(proc.stdout.splitlines()) == len(table) + 2  # the table, a blank, the logs line
    checks = {line.split(" | ")[0].removeprefix("| "): line for line in table[2:]}
    for precision in ("bf16", "fp16"):
        assert checks[f"flat {precision}: loss"].endswith("| PASS |")
        assert checks[f"1-stage pipeline {precision} vs flat {precision}: loss"].endswith(
            "| PASS |"
        )
        assert checks[f"1-stage pipeline {precision}: gradient norm"].endswith("| PASS |")
        assert (
            "equal"
            in checks[f"activation checkpointing on = off ({precision}): loss, gradient norm"]
        )
    assert checks["2 stages vs 1 stage, 8 updates, fp32: loss"].endswith("| PASS |")
    assert "not run: 2 rank(s)" in checks["4 stages vs 1 stage"]
    assert "Apex FusedLayerNorm" in " ".join(checks)
    assert any(
        c.startswith("train.py 2L-2L tiny (CPU), bf16, as shipped: tokens/s") for c in checks
    )
    assert "of the bf16 matmul peak" in " ".join(checks.values())
    assert checks["host syncs per micro-batch inside train_batch"].endswith("| PASS |")
    assert any(c.startswith("kernel ops per layer per micro-batch (tiny_cpu") for c in checks)
    assert checks["2 stages bf16 + ZeRO-1 end to end: updates, finite losses"].endswith("| PASS |")


def test_a_failed_check_exits_1(monkeypatch, capsys, tmp_path):
    rows = [gpu_check.Row("a figure", "1"), gpu_check.Row("a check", "2e-1", "1e-2", False)]
    monkeypatch.setattr(gpu_check, "run_checks", lambda *a: rows)
    assert gpu_check.main(["--device", "cpu", "--workdir", str(tmp_path)]) == 1
    assert "| a check | 2e-1 | 1e-2 | FAIL |" in capsys.readouterr().out


def test_rows_are_printed_as_each_section_ends(monkeypatch, capsys, tmp_path):
    """A check cut off mid-way (a lent GPU's time limit, Ctrl-C) has already printed the
    sections it finished, under the table's header, and written them to --json."""
    import json

    def cut_off(device, ranks, steps, work, emit, sections):
        emit([gpu_check.Row("environment", "here")])
        emit([gpu_check.Row("precision", "1e-4", "1e-2", True)])
        raise KeyboardInterrupt  # the next section never ends

    monkeypatch.setattr(gpu_check, "run_checks", cut_off)
    rows_json = tmp_path / "rows.json"
    argv = ["--device", "cpu", "--workdir", str(tmp_path), "--json", str(rows_json)]
    assert gpu_check.main(argv) == 130
    out = capsys.readouterr().out.splitlines()
    assert out[:4] == [
        "| check | value | limit | verdict |",
        "| --- | --- | --- | --- |",
        "| environment | here |  |  |",
        "| precision | 1e-4 | 1e-2 | PASS |",
    ]
    assert [r["check"] for r in json.loads(rows_json.read_text())] == ["environment", "precision"]


def test_cuda_where_there_is_none_is_one_line(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device on this machine: --device cuda is valid here")
    assert gpu_check.main(["--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "torch sees no CUDA device" in err[0]


def test_the_graph_rows_run_each_variant_graphed_and_share_an_eager_run(monkeypatch, tmp_path):
    """The CUDA-graph rows as on a GPU, train.py stood in (its launches recorded, its losses
    equal): a graphed run per variant, in flight, recomputing and recomputing in links
    (docs/design.md §19, "Links"), and one eager run per setting that changes what eager
    runs: the two recomputing variants share theirs, which never gets the link key."""
    launched: list[list[str]] = []

    def launch(world, overrides, save_dir, timeout):
        launched.append(list(overrides))
        save_dir.mkdir(parents=True)
        log = (
            "cuda graphs: layers 1-7: first graph captured"
            if "model.cuda_graphs=on" in overrides
            else ""
        )
        (save_dir.parent / f"{save_dir.name}.rank0.log").write_text(log)
        return 1.0

    monkeypatch.setattr(gpu_check, "_launch", launch)
    monkeypatch.setattr(
        gpu_check, "_updates", lambda _d: [{"step": s, "loss": 5.0} for s in (1, 2)]
    )
    rows = gpu_check.cuda_graph_rows("cuda", tmp_path)
    assert [r.ok for r in rows] == [True, True, True]
    assert "recomputing stage in links" in rows[2].check
    eager = [o for o in launched if "model.cuda_graphs=off" in o]
    graphed = [o for o in launched if "model.cuda_graphs=on" in o]
    assert len(eager) == 2 and len(graphed) == 3
    assert not any(o.startswith("model.cuda_graph_link_layers=") for run in eager for o in run)
    assert "model.cuda_graph_link_layers=2" in graphed[2]
    assert "pipeline.activation_checkpoint_interval=1" in graphed[2]


def test_sections_run_only_what_is_asked_in_their_order(monkeypatch, tmp_path):
    """--sections graphs,precision runs the environment's rows, then precision, then the
    graphs (the module's order, not the flag's), and nothing else: what a lent GPU's call asks
    first."""
    ran: list[str] = []
    for fn, name in [("precision_rows", "precision"), ("apex_rows", "apex"),
                     ("recompute_dropout_rows", "graphs"), ("cuda_graph_rows", "graphs"),
                     ("launch_rows", "launches"), ("throughput_rows", "throughput"),
                     ("two_stage_rows", "two-stage"), ("parity_rows", "parity")]:  # fmt: skip
        monkeypatch.setattr(
            gpu_check, fn, lambda *_a, n=name: ran.append(n) or [gpu_check.Row(n, "ran")]
        )
    monkeypatch.setattr(gpu_check, "environment", lambda _d: [gpu_check.Row("environment", "")])
    import deepspeed
    import torch.distributed as dist

    # no process group is left behind for the tests that start their own
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **_k: None)
    argv = ["--device", "cpu", "--workdir", str(tmp_path / "w"), "--sections", "graphs,precision"]
    assert gpu_check.main(argv) == 0
    assert ran == ["precision", "graphs", "graphs"]
    assert not dist.is_initialized()


def test_an_unknown_section_is_one_line(capsys, tmp_path):
    assert gpu_check.main(["--device", "cpu", "--sections", "graphs,speed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--sections: unknown speed" in err[0], err
