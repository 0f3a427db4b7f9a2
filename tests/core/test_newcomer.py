"""What a first user meets with only the README, the docs and ``--help``: ``make help``, the
trainer's ``--print-config``, a run's ``config.yaml`` given back as ``--config``, a busy
rendezvous port refused before the slow start-up, a build lock said at once, and the memory
planner's vocabulary from the DATA_DIR's manifest. All in-process but ``make help``."""

from __future__ import annotations

import importlib
import json
import os
import re
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from megatron_branchnorm.config import dump_config, load_config
from megatron_branchnorm.formats.data_dir import FORMAT, MANIFEST, VERSION
from megatron_branchnorm.runner.launch import (
    AGENT_STORE,
    RENDEZVOUS_FD,
    HeldPort,
    LaunchError,
    check_rendezvous_port,
)
from megatron_branchnorm.training import stop_signals

ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# make help
# --------------------------------------------------------------------------------------------


def test_make_help_lists_every_target_with_one_line():
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))
    dry = subprocess.run(["make", "-n", "help"], cwd=ROOT, capture_output=True, text=True)
    assert dry.returncode == 0 and "pip" not in dry.stdout, dry.stdout + dry.stderr  # no set-up
    out = subprocess.run(["make", "-s", "help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    listed = {}
    for line in out.stdout.splitlines():
        name, _, what = line.strip().partition(" ")
        listed[name] = what.strip()
    for name in ("test", "demo", "venv", "gpu-check", "gpu-bench", "lint", "help"):
        assert listed.get(name), (name, out.stdout)
    assert set(listed) == targets, out.stdout
    assert "set-up" in listed["venv"]


# --------------------------------------------------------------------------------------------
# train.py: --print-config, --config SAVE_DIR/config.yaml, the port checked first
# --------------------------------------------------------------------------------------------


@pytest.fixture
def train(monkeypatch):
    """megatron_branchnorm.train without its stop-signal handlers in this process (a rank's),
    and a stand-in trainer module that records whether the front door reached it."""
    monkeypatch.setattr(stop_signals, "install", lambda: None)
    module = importlib.import_module("megatron_branchnorm.train")
    reached: list[str] = []
    stub = types.ModuleType("megatron_branchnorm.training.trainer")

    def run(cfg) -> int:
        reached.append("run")
        return 0

    stub.run = run
    monkeypatch.setitem(sys.modules, "megatron_branchnorm.training.trainer", stub)
    return types.SimpleNamespace(main=module.main, parse_args=module.parse_args, reached=reached)


def test_print_config_prints_the_resolved_config_and_starts_nothing(train, capsys):
    overrides = ["model.encoder_layers=3", "train.lr=1e-3"]
    assert train.main(["--config", "demo_cpu", *overrides, "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and train.reached == []
    printed = yaml.safe_load(out)
    assert printed == load_config("demo_cpu", overrides).to_dict()
    assert printed["model"]["encoder_layers"] == 3 and printed["train"]["lr"] == 1e-3
    assert printed["model"]["layernorm_eps"] == 1e-5  # a default the YAML leaves out


def test_print_config_with_a_bad_key_is_one_line(train, capsys):
    assert train.main(["--config", "demo_cpu", "model.no_such_key=1", "--print-config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and train.reached == []
    assert len(err.splitlines()) == 1 and err.startswith("error: config key model.no_such_key")


def test_a_runs_config_yaml_given_back_loads_the_same_config(train, capsys, tmp_path):
    """The trainer writes SAVE_DIR/config.yaml with dump_config (Checkpointer.record_start):
    given back as --config, it is the same config without repeating the overrides."""
    overrides = ["model.encoder_layers=3", "model.cuda_graphs=on", f"train.save_dir={tmp_path}"]
    cfg = load_config("demo_cpu", overrides)
    dump_config(cfg, tmp_path / "config.yaml")
    assert load_config(str(tmp_path / "config.yaml")) == cfg
    assert train.main(["--config", str(tmp_path / "config.yaml"), "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out) == cfg.to_dict()
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    assert "--config SAVE_DIR/config.yaml" in " ".join(capsys.readouterr().out.split())


@pytest.fixture
def busy_port():
    """A port that a listening socket of this test holds (whatever port the system gives)."""
    sock = socket.socket()
    sock.bind(("", 0))
    sock.listen(1)
    yield sock.getsockname()[1]
    sock.close()


def _rank_env(monkeypatch, **env: str) -> None:
    for key in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "SLURM_PROCID",
        "MASTER_ADDR",
        "MASTER_PORT",
        RENDEZVOUS_FD,
        AGENT_STORE,
    ):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)


def test_a_busy_master_port_is_refused_before_the_trainer_starts(
    train, capsys, monkeypatch, busy_port
):
    _rank_env(monkeypatch, RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(busy_port))
    assert train.main(["--config", "tiny_cpu"]) == 2
    err = capsys.readouterr().err
    assert train.reached == [], "the trainer started before the port was checked"
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: environment variable MASTER_PORT: ")
    assert f"127.0.0.1:{busy_port} is already in use" in err


def test_srun_rank_0_checks_the_port_and_other_ranks_do_not(monkeypatch, busy_port):
    port = str(busy_port)
    _rank_env(monkeypatch, SLURM_PROCID="0", MASTER_ADDR="node1", MASTER_PORT=port)
    with pytest.raises(LaunchError, match=f"node1:{port} is already in use"):
        check_rendezvous_port()
    for env in ({"SLURM_PROCID": "1"}, {"RANK": "3"}, {"RANK": "0", AGENT_STORE: "True"}):
        _rank_env(monkeypatch, MASTER_ADDR="node1", MASTER_PORT=port, **env)
        check_rendezvous_port()  # rank 0 binds it elsewhere, or torchrun's agent holds it


def test_the_port_this_projects_launcher_holds_for_rank_0_passes(monkeypatch):
    with HeldPort() as held:  # bound and listening until rank 0 takes it over
        _rank_env(monkeypatch, RANK="0", MASTER_PORT=str(held.port), **{RENDEZVOUS_FD: "7"})
        check_rendezvous_port()


def test_rank_without_world_size_is_one_line(monkeypatch):
    """RANK=0 MASTER_PORT=P by hand, as for a rank 0: a KeyError traceback in the trainer."""
    from megatron_branchnorm.config import ConfigError
    from megatron_branchnorm.training import environment

    _rank_env(monkeypatch, RANK="0", MASTER_PORT="29500")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ConfigError, match=r"^environment variable WORLD_SIZE: not set, but RANK"):
        environment.setup_process_env()


# --------------------------------------------------------------------------------------------
# torch's build lock of DeepSpeed's CPU op
# --------------------------------------------------------------------------------------------


def _stale_lock(monkeypatch, tmp_path: Path) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setenv("RANK", "0")
    lock = tmp_path / "deepspeed_shm_comm" / "lock"  # torch's layout under TORCH_EXTENSIONS_DIR
    lock.parent.mkdir(exist_ok=True)  # torch's build-directory lookup may have made it
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # a build killed an hour ago
    return lock


def test_a_stale_build_lock_is_named_with_the_way_out(monkeypatch, tmp_path):
    from megatron_branchnorm.training import environment

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert environment.build_lock_line("deepspeed_shm_comm", 600.0) is None
    lock = _stale_lock(monkeypatch, tmp_path)
    line = environment.build_lock_line("deepspeed_shm_comm", 600.0)
    assert line is not None and "\n" not in line
    assert line.startswith(f"rank 0: a build lock {lock} exists, 36")
    assert "died while building deepspeed_shm_comm" in line and line.endswith(f"remove {lock}")
    assert "train.collective_timeout_s=600 s" in line


def test_a_lock_of_a_running_load_or_build_is_not_called_stale(monkeypatch, tmp_path):
    from megatron_branchnorm.training import environment

    lock = _stale_lock(monkeypatch, tmp_path)
    monkeypatch.setattr(environment, "_works_in", lambda directory: directory == lock.parent)
    assert environment.build_lock_line("deepspeed_shm_comm", 600.0) is None  # ninja runs there
    monkeypatch.setattr(environment, "_works_in", lambda directory: False)
    os.utime(lock)  # taken just now: a load holds it for milliseconds
    assert environment.build_lock_line("deepspeed_shm_comm", 600.0) is None


def test_the_lock_is_said_before_the_load_waits_on_it(monkeypatch, tmp_path, capsys):
    from megatron_branchnorm.training import environment

    lock = _stale_lock(monkeypatch, tmp_path)
    said_before_load = []

    class Builder:
        name = "deepspeed_shm_comm"

        def load(self):
            said_before_load.append(capsys.readouterr().err)

    environment.load_op(Builder(), 600.0)
    assert len(said_before_load) == 1
    assert said_before_load[0].startswith(f"rank 0: a build lock {lock} exists")


# --------------------------------------------------------------------------------------------
# plan_memory.py: the vocabulary of the DATA_DIR
# --------------------------------------------------------------------------------------------


@pytest.fixture
def data_dir(tmp_path) -> Path:
    """A DATA_DIR manifest of an 8,000-piece vocabulary (what the planner reads of it)."""
    d = tmp_path / "data"
    d.mkdir()
    (d / "spm.model").write_bytes(b"")
    split = {"directions": {"de-en": {"src": "train.de", "tgt": "train.en", "sentences": 10}}}
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "vocab_size": 8000,
        "languages": ["de", "en"],
        "tag_ids": {"de": 4, "en": 5},
        "spm_model": "spm.model",
        "directions": ["de-en"],
        "splits": {"train": split},
    }
    (d / MANIFEST).write_text(json.dumps(manifest), encoding="utf-8")
    return d


def _plan_args(data_dir: Path, tmp_path: Path, *extra: str) -> list[str]:
    return [
        "--config", "demo_cpu", "--gpus", "2", f"data.dataset={data_dir}",
        f"train.save_dir={tmp_path / 'run'}", *extra,
    ]  # fmt: skip


def test_the_planner_takes_the_vocabulary_of_the_data_dir(data_dir, tmp_path, capsys):
    from megatron_branchnorm.commands import plan

    assert plan.main(_plan_args(data_dir, tmp_path)) == 0
    out, err = capsys.readouterr()
    assert "vocab=8000" in out and err == "", out
    assert plan.main(_plan_args(data_dir, tmp_path, "--vocab-size", "32000")) == 0
    out, err = capsys.readouterr()
    assert "vocab=8000" in out
    assert err.startswith("warning: --vocab-size 32000 differs from the vocab_size 8000 of ")


def test_the_planner_refuses_a_vocabulary_the_data_dir_contradicts(data_dir, tmp_path, capsys):
    from megatron_branchnorm.commands import plan

    assert plan.main(_plan_args(data_dir, tmp_path, "model.vocab_size=64000")) == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("error: config key model.vocab_size:")
    assert "vocab_size=8000" in err and MANIFEST in err
