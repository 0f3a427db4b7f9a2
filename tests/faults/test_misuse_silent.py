"""Misuse cases that used to give silent wrong results or a traceback: each
is now one line naming the file, key, line or variable, and exit 2 where a command runs."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.data.sampling import temperature_probs
from megatron_branchnorm.data.spm import SpmOptions, sample_plan
from megatron_branchnorm.parallel.partition import layout_parts
from megatron_branchnorm.training import environment
from tests.faults.common import ROOT

PY = sys.executable


def run_tool(tool: str, *args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [PY, str(ROOT / "tools" / tool), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )


def one_error_line(proc: subprocess.CompletedProcess) -> str:
    """The single ``error:`` line of a refused command (no traceback), exit 2."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


# §4 -------------------------------------------------------------------------------------


def test_duplicate_section_or_key_in_a_config_names_the_line(tmp_path):
    cfg = tmp_path / "mine.yaml"
    cfg.write_text(
        "model:\n  encoder_layers: 1\n  hidden_size: 32\ntrain:\n  max_steps: 2\n"
        "model:\n  encoder_layers: 6\n"
    )
    with pytest.raises(ConfigError, match=r"mine.yaml: line 6: duplicate key 'model' \(first at line 1\)"):  # fmt: skip
        load_config(cfg)
    cfg.write_text("model:\n  hidden_size: 32\n  hidden_size: 512\n")
    with pytest.raises(ConfigError, match=r"line 3: duplicate key 'hidden_size' \(first at line 2\)"):  # fmt: skip
        load_config(cfg)
    # the same key in two sections is fine; so are the shipped configs
    cfg.write_text("model:\n  dropout: 0.0\ntrain:\n  max_steps: 2\n")
    assert load_config(cfg).model.dropout == 0.0
    (tmp_path / "dup.yaml").write_text("model:\n  hidden_size: 32\nmodel:\n  hidden_size: 64\n")
    line = one_error_line(
        run_tool("plan_memory.py", "--config", str(tmp_path / "dup.yaml"), "--gpus", "1")
    )
    assert "dup.yaml: line 3: duplicate key 'model'" in line


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "model.encoder_layers=1:30",
            "config key model.encoder_layers: expected int \\(a plain decimal integer",
        ),  # fmt: skip
        (
            "model.encoder_layers=0x10",
            "config key model.encoder_layers: expected int \\(a plain decimal integer",
        ),  # fmt: skip
        (
            "model.encoder_layers=010",
            "config key model.encoder_layers: expected int \\(a plain decimal integer",
        ),  # fmt: skip
        (
            "model.encoder_layers=1_0",
            "config key model.encoder_layers: expected int \\(a plain decimal integer",
        ),  # fmt: skip
        ("train.lr=1:30", "config key train.lr: expected float \\(a plain decimal number"),
        ("train.lr=0x10", "config key train.lr: expected float \\(a plain decimal number"),
        ("model.compile=yes", "config key model.compile: expected bool \\(true or false\\)"),
        ("model.encoder_layers=" + "9" * 5000, "config key model.encoder_layers: '9999"),
    ],
)
def test_overrides_refuse_yaml11_numbers(override, message):
    with pytest.raises(ConfigError, match=message) as info:
        load_config("tiny_cpu", [override])
    assert "\n" not in str(info.value)


def test_overrides_take_what_a_person_means():
    cfg = load_config(
        "tiny_cpu",
        [
            "train.save_dir=runs/x #note",
            "model.encoder_layers=3",
            "train.lr=5e-4",
            "train.warmup_init_lr=.5",
            "train.clip_grad=1",
            "model.compile=false",
            "model.vocab_size=null",
            "data.dataset=0x10",
            "pipeline.activation_checkpoint_interval=auto",
        ],
    )
    assert cfg.train.save_dir == "runs/x #note"
    assert cfg.model.encoder_layers == 3 and cfg.train.lr == 5e-4
    assert cfg.train.warmup_init_lr == 0.5 and cfg.train.clip_grad == 1.0
    assert cfg.model.compile is False and cfg.model.vocab_size is None
    assert cfg.data.dataset == "0x10"
    assert cfg.pipeline.activation_checkpoint_interval == "auto"
    assert load_config("tiny_cpu", ["pipeline.activation_checkpoint_interval=2"]).pipeline.activation_checkpoint_interval == 2  # fmt: skip


def _old_probs(counts, temperature):
    n = np.asarray(counts, dtype=np.float64)
    w = np.where(n > 0, n ** (1.0 / temperature), 0.0)
    return w / w.sum()


@pytest.mark.parametrize("temperature", [0.01, 0.05, 1e-300, 5e-324])
def test_temperature_probs_finite_at_small_temperatures(temperature):
    p = temperature_probs([3000, 150, 0, 2999], temperature)
    assert np.isfinite(p).all() and abs(p.sum() - 1.0) < 1e-12
    assert p[2] == 0.0 and p[0] >= p[3] >= p[1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0, 5.0, 100.0])
def test_temperature_probs_bit_identical_where_the_old_formula_was_finite(temperature):
    counts = [1_000_000, 2000, 0, 55_123, 1]
    assert temperature_probs(counts, temperature).tobytes() == _old_probs(counts, temperature).tobytes()  # fmt: skip


def test_spm_sample_at_the_smallest_spm_temperature_is_full_size():
    # preprocess --spm-temperature 0.01 (the allowed minimum) sampled 1,193 of 3,000 lines
    plan = sample_plan({"de": 3000, "en": 3150, "fr": 150}, SpmOptions(sample_size=3000, temperature=0.01))  # fmt: skip
    assert sum(len(v) for v in plan.values()) == 3000


def test_evaluate_refuses_a_reference_shifted_after_preprocessing(tmp_path, capsys):
    from megatron_branchnorm.commands import evaluate as evaluate_cmd
    from tests.data.conftest import make_opus, run_preprocess

    make_opus(tmp_path / "raw", {"de": (60, 10, 12)})
    data = tmp_path / "data"
    run_preprocess(tmp_path / "raw", data, ["de"], max_len=64)
    ref = data / "raw" / "test.de-en.en"
    lines = ref.read_text(encoding="utf-8").splitlines(keepends=True)
    ref.write_text("".join(lines[1:] + lines[:1]), encoding="utf-8")  # same count, shifted
    argv = ["--model", str(tmp_path / "no_export"), "--data", str(data), "--split", "test"]
    assert evaluate_cmd.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {ref}: not the test ")
    assert "sha256 differs" in err[0]


# §5 -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "train.collective_timeout_s=1e10",
            "train.collective_timeout_s: must be > 0 and at most 604800",
        ),  # fmt: skip
        (
            "train.collective_timeout_s=1e300",
            "train.collective_timeout_s: must be > 0 and at most 604800",
        ),  # fmt: skip
        ("train.save_dir=runs/a\x00b", "config key train.save_dir: contains a NUL byte"),
        ("data.dataset=d\x00", "config key data.dataset: contains a NUL byte"),
    ],
)
def test_config_bounds(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny_cpu", [override])


def test_partition_repeat_count_is_bounded():
    model = load_config("tiny_cpu").model
    for layout in ("E e*99999999999999999999 | d*2 L", "E e*999999999 | d L", "E e*" + "9" * 5000):
        with pytest.raises(ConfigError, match="counts more than the"):
            layout_parts(model, layout)
    line = one_error_line(
        run_tool(
            "plan_memory.py", "--config", "tiny_cpu", "--gpus", "2", "pipeline.stages=2",
            "pipeline.partition=E e*99999999999999999999 | d*2 L",
        )
    )  # fmt: skip
    assert "config key pipeline.partition: layout" in line


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"RANK": "abc", "WORLD_SIZE": "2"}, "environment variable RANK: expected an integer >= 0"),
        ({"RANK": "-1", "WORLD_SIZE": "2"}, "environment variable RANK: expected an integer >= 0"),
        ({"RANK": "2", "WORLD_SIZE": "2"}, "environment variable RANK: 2, but WORLD_SIZE is 2"),
        (
            {"RANK": "0", "WORLD_SIZE": "0"},
            "environment variable WORLD_SIZE: expected an integer >= 1",
        ),  # fmt: skip
        ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_SIZE": "x"}, "environment variable LOCAL_SIZE"),
        (
            {"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"},
            r"MASTER_PORT: expected an integer in \[1, 65535\]",
        ),  # fmt: skip
        (
            {"SLURM_PROCID": "0", "MASTER_ADDR": "127.0.0.1", "SLURM_NTASKS": "two"},
            "environment variable SLURM_NTASKS",
        ),  # fmt: skip
    ],
)
def test_bad_launcher_environment_is_one_line(monkeypatch, env, message):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_PORT", "SLURM_PROCID"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=message):
        environment.setup_process_env()


def test_busy_master_port_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        proc = subprocess.run(
            [PY, str(ROOT / "megatron_branchnorm" / "train.py"), "--config", "tiny_cpu",
             "train.max_steps=1", f"train.save_dir={tmp_path / 'run'}"],
            capture_output=True, text=True, timeout=300, env=env, cwd=ROOT,
        )  # fmt: skip
    line = one_error_line(proc)
    assert f"environment variable MASTER_PORT: 127.0.0.1:{port} is already in use" in line


def _sweep_dir(root: Path) -> Path:
    save_dir = root / "postln_6L" / "run"
    save_dir.mkdir(parents=True)
    (save_dir / "metrics.jsonl").write_text(json.dumps({"step": 2, "valid_loss": 4.0}) + "\n")
    cell = {"scheme": "postln", "depth": 6, "save_dir": str(save_dir)}
    (root / "sweep.json").write_text(json.dumps({"cells": {"postln_6L": cell}}))
    return root


def test_sweep_table_misuse(tmp_path):
    out = _sweep_dir(tmp_path / "sweep")
    registry = (out / "sweep.json").read_bytes()
    table = ("table", str(out), "--metric", "valid_loss")
    line = one_error_line(run_tool("sweep.py", *table, "--markdown", str(out / "sweep.json")))
    assert "is the same path as the registry" in line
    assert (out / "sweep.json").read_bytes() == registry
    (tmp_path / "a_dir").mkdir()
    assert "is a directory" in one_error_line(run_tool("sweep.py", *table, "--json", str(tmp_path / "a_dir")))  # fmt: skip
    assert "contains the registry" in one_error_line(run_tool("sweep.py", *table, "--json", str(tmp_path)))  # fmt: skip
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"postln": {"6": [1, 2]}}))
    assert "postln at depth 6 is [1, 2]" in one_error_line(run_tool("sweep.py", *table, "--paper", str(bad)))  # fmt: skip
    for paper in ("[1]", "5"):
        assert "--paper" in one_error_line(run_tool("sweep.py", *table, "--paper", paper))
    for damaged in ("{not json", "[]", '{"cells": {"x": {"scheme": 1}}}'):
        (out / "sweep.json").write_text(damaged)
        assert "not a sweep registry" in one_error_line(run_tool("sweep.py", *table))
    assert "unrecognized arguments" in one_error_line(run_tool("sweep.py", *table, "--bogus"))


def test_sweep_submit_misuse(tmp_path):
    launcher = str(ROOT / "slurm" / "tiny_cpu.sh")
    a_file = tmp_path / "file"
    a_file.write_text("")
    submit = ("submit", "--launcher", launcher)
    line = one_error_line(run_tool("sweep.py", *submit, "--depths", "6", "--out", str(a_file)))
    assert f"--out {a_file}: is not a directory" in line
    env = {**os.environ, "PATH": str(tmp_path / "empty_bin")}
    line = one_error_line(
        run_tool("sweep.py", *submit, "--depths", "6", "--out", str(tmp_path / "s"), env=env)
    )
    assert "sbatch: not found on PATH" in line and not (tmp_path / "s").exists()
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    log = tmp_path / "sbatch.log"
    (fake_bin / "sbatch").write_text(f'#!/bin/sh\necho "$@" >> {log}\necho 1\n')
    (fake_bin / "sbatch").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake_bin}:{os.environ['PATH']}"}
    out = tmp_path / "s2"
    line = one_error_line(
        run_tool(
            "sweep.py", *submit, "--depths", "6,99999999999999999999", "--out", str(out), env=env
        )  # fmt: skip
    )
    assert "--depths '6,99999999999999999999': expected depths in [1, 1000]" in line
    assert not log.exists() and not out.exists()
    assert shutil.which("sbatch", path=str(fake_bin))
