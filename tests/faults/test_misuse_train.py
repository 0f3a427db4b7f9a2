"""Misuse of train.py (issue: misuse and bad input): two runs in one save_dir, a checkpoint
resumed with another vocabulary or with a changed architecture key, and bad input that must
end in one line and exit 2 on every rank (data, save_dir, DeepSpeed JSON, numbers, a full
disk, Ctrl-C). docs/reliability.md, "Misuse", lists each case with its test.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from megatron_branchnorm.config import ConfigError, ExperimentConfig, load_config
from megatron_branchnorm.experiments.fault_inject import FAULT_ENV
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.runner.ranks import start_ranks
from megatron_branchnorm.training import resume_policy
from megatron_branchnorm.training.run_lock import LOCK_NAME, STALE_S, LockError, RunLock
from tests.data.conftest import make_opus, run_preprocess
from tests.faults.common import INJECTOR, TRAIN, records
from tests.pipeline.conftest import ROOT, rank_env

pytestmark = pytest.mark.faults

TINY = [
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "model.hidden_size=16",
    "model.ffn_hidden_size=32",
    "model.num_attention_heads=2",
    "model.dropout=0.0",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.warmup_steps=4",
    "train.collective_timeout_s=60",
]
"""A 1L-1L d=16 model: the cases here are about what surrounds training, not the model."""


def start(
    save_dir: Path, overrides: list[str], world: int = 1, fault: str = ""
) -> list[subprocess.Popen]:
    """``world`` ranks of train.py on tiny_cpu + TINY (+ overrides), stdout and stderr piped
    apart (:func:`megatron_branchnorm.runner.ranks.start_ranks` without a log directory)."""
    stages = [] if world == 1 else [f"pipeline.stages={world}"]
    # with a fault, train.py's main inside the test-only fault injector
    entry = ["-m", INJECTOR] if fault else [TRAIN]
    args = [*entry, "--config", "tiny_cpu", *TINY, *stages, f"train.save_dir={save_dir}"]
    env = {FAULT_ENV: fault} if fault else None  # rank_env gives no MBN_FAULT* variable
    return start_ranks(world, [*args, *overrides], None, module=None, env=env, cwd=ROOT).procs


def finish(procs: list[subprocess.Popen], timeout: float = 300) -> list[tuple[int, str, str]]:
    """(exit code, stdout, stderr) of every rank."""
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout, stderr))
    return out


def train(save_dir: Path, overrides: list[str], world: int = 1, fault: str = ""):
    return finish(start(save_dir, overrides, world, fault))


def error_line(result: tuple[int, str, str]) -> str:
    """The one error line of a rank that exited 2 (and no traceback)."""
    code, stdout, stderr = result
    assert code == 2, f"exit {code}\n{stdout[-2000:]}\n{stderr[-3000:]}"
    assert "Traceback" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-update run (checkpoints at 1 and 2) on synthetic data."""
    save_dir = tmp_path_factory.mktemp("misuse") / "run"
    (result,) = train(save_dir, ["train.max_steps=2", "train.save_interval=1"])
    assert result[0] == 0, result[2][-3000:]
    return save_dir


# --------------------------------------------------------------------------------------------
# Config drift on resume
# --------------------------------------------------------------------------------------------


def test_every_config_key_is_fixed_or_may_change():
    keys = set(resume_policy.flatten(ExperimentConfig().to_dict()))
    fixed, free = set(resume_policy.FIXED), set(resume_policy.MAY_CHANGE)
    assert not fixed & free
    assert fixed | free == keys, sorted(keys ^ (fixed | free))


@pytest.mark.parametrize(
    "override",
    [
        "model.activation=gelu",
        "model.layernorm_eps=1e-6",
        "model.max_positions=256",
        "model.branchnorm_steps=1",
        "model.branch_init=xavier",
        "data.max_tokens=1024",
        "train.seed=7",
    ],
)
def test_resume_refuses_a_fixed_key(finished_run, override):
    saved = json.loads((finished_run / "global_step2" / "train_config.json").read_text())
    current = load_config("tiny_cpu", [*TINY, f"train.save_dir={finished_run}", override])
    key = override.split("=")[0]
    with pytest.raises(resume_policy.ResumeConfigError, match=rf"config key {key}: .* differs"):
        resume_policy.check_resume(saved["config"], current.to_dict(), "global_step2")


def test_resume_allows_schedules_and_layout(finished_run):
    saved = json.loads((finished_run / "global_step2" / "train_config.json").read_text())
    overrides = ["train.max_steps=9", "train.lr=0.002", "pipeline.stages=2", "model.dropout=0.2"]
    current = load_config(
        "tiny_cpu", [*TINY, "train.save_interval=1", f"train.save_dir={finished_run}", *overrides]
    )
    diff = resume_policy.check_resume(saved["config"], current.to_dict(), "global_step2")
    assert set(diff) == {"train.max_steps", "train.lr", "pipeline.stages", "model.dropout"}
    assert diff["train.lr"] == [0.001, 0.002]


def test_train_refuses_a_drifted_resume_and_keeps_the_config(finished_run, tmp_path):
    """branchnorm_steps 100 -> 1 would make alpha jump from 0.03 to 1 at the resumed step."""
    before = (finished_run / "config.yaml").read_text()
    (result,) = train(finished_run, ["train.max_steps=3", "model.branchnorm_steps=1"])
    line = error_line(result)
    assert "config key model.branchnorm_steps: 1 differs from the checkpoint's 100" in line
    assert (finished_run / "config.yaml").read_text() == before
    assert ckpt.read_latest(finished_run) == "global_step2"


def test_a_changed_learning_rate_takes_effect_and_is_recorded(finished_run, tmp_path):
    """Resume with lr doubled: the restored optimizer and scheduler state carried the old
    lr (before the fix the new one was silently ignored); the change goes to the history."""
    run = tmp_path / "run"
    import shutil

    shutil.copytree(finished_run, run)
    (result,) = train(run, ["train.max_steps=3", "train.lr=0.002"])
    assert result[0] == 0, result[2][-3000:]
    rows = {r["step"]: r for r in records(run)}
    # update t = 3 during warm-up (4 updates from 1e-7 to lr): lr = 1e-7 + (lr - 1e-7) * 3 / 4
    assert rows[3]["lr"] == pytest.approx(1e-7 + (0.002 - 1e-7) * 3 / 4, rel=1e-12)
    assert rows[2]["lr"] == pytest.approx(1e-7 + (0.001 - 1e-7) * 2 / 4, rel=1e-12)
    history = [json.loads(line) for line in (run / resume_policy.HISTORY).read_text().splitlines()]
    assert history[-1]["resumed_from"] == "global_step2"
    assert history[-1]["changed"]["train.lr"] == [0.001, 0.002]
    assert history[-1]["changed"]["train.max_steps"] == [2, 3]
    assert yaml.safe_load((run / "config.yaml").read_text())["train"]["lr"] == 0.002
    assert "config key train.lr changed on resume: 0.001 -> 0.002" in result[1]


# --------------------------------------------------------------------------------------------
# Two runs in one save_dir: the lock
# --------------------------------------------------------------------------------------------


def write_lock(save_dir: Path, **holder) -> Path:
    save_dir.mkdir(parents=True, exist_ok=True)
    path = save_dir / LOCK_NAME
    record = {"host": socket.gethostname(), "pid": None, "started": "earlier", "token": "x"}
    record.update(holder)
    path.write_text(json.dumps(record))
    return path


def test_lock_refuses_a_live_run_on_this_host(tmp_path):
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_lock(tmp_path, pid=other.pid)
        with pytest.raises(LockError, match=f"another run trains .*pid {other.pid} on"):
            RunLock(tmp_path).acquire()
    finally:
        other.kill()
        other.wait()
    lock = RunLock(tmp_path)  # now its process is gone: taken over, with a warning
    lock.acquire()
    assert lock.owned() and "no longer runs" in lock.warnings[0]
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_lock_sees_pid_reuse(tmp_path):
    """A live pid whose start time differs from the lock's is another process."""
    write_lock(tmp_path, pid=os.getppid(), pid_start="1")
    lock = RunLock(tmp_path)
    lock.acquire()
    assert "no longer runs" in lock.warnings[0]
    lock.release()


def test_lock_from_another_host_is_stale_only_without_heartbeat(tmp_path):
    path = write_lock(tmp_path, host="node-elsewhere", pid=1)
    with pytest.raises(LockError, match="node-elsewhere"):
        RunLock(tmp_path).acquire()
    old = time.time() - STALE_S - 60
    os.utime(path, (old, old))
    lock = RunLock(tmp_path)
    lock.acquire()
    assert "heartbeat" in lock.warnings[0]
    lock.release()


def test_lock_of_a_requeued_slurm_job_is_taken_over(tmp_path, monkeypatch):
    write_lock(tmp_path, host="node-elsewhere", pid=1, slurm_job_id="4242")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    lock = RunLock(tmp_path)
    lock.acquire()
    assert "requeued" in lock.warnings[0]
    lock.release()


@pytest.mark.parametrize(
    "squeue, taken",
    [
        ("echo RUNNING", False),
        ("echo NODE_FAIL", True),
        ("true", True),  # no longer listed
        ('echo "slurm_load_jobs error: Invalid job id specified" >&2; exit 1', True),
        ('echo "Unable to contact slurm controller" >&2; exit 1', False),
    ],
)
def test_lock_of_an_ended_slurm_job_on_another_host(tmp_path, monkeypatch, squeue, taken):
    """A node lost with rank 0 on it leaves a fresh lock from another host; the resubmitted
    job (another SLURM job id) takes it over once squeue says that job has ended, instead of
    waiting out the heartbeat (run_lock.slurm_job_ended)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(f"#!/bin/sh\n{squeue}\n")
    (bin_dir / "squeue").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "4243")
    save_dir = tmp_path / "run"
    write_lock(save_dir, host="node-elsewhere", pid=1, slurm_job_id="4242")
    lock = RunLock(save_dir)
    if taken:
        lock.acquire()
        assert "its SLURM job 4242 has ended (squeue)" in lock.warnings[0]
        lock.release()
    else:
        with pytest.raises(LockError, match="SLURM job 4242"):
            lock.acquire()


def test_release_leaves_another_runs_lock(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    path = write_lock(tmp_path, host="node-elsewhere", pid=1)  # replaced under us
    lock.release()
    assert path.exists()


def test_second_train_in_the_same_save_dir_refuses_to_start(tmp_path):
    save_dir, go = tmp_path / "run", tmp_path / "go"
    # the first run is held before its second update until the second start has been refused
    # (before, a sleep before each update had to outlast the second start: at 2 s a loaded
    # 2-core machine let the first finish first, exit 0)
    first = start(save_dir, ["train.max_steps=3", "train.save_interval=0"], fault=f"hold@{go}")
    deadline = time.time() + 240
    while not records(save_dir) and time.time() < deadline and first[0].poll() is None:
        time.sleep(0.2)
    assert records(save_dir), "the first run logged no update"
    (second,) = train(save_dir, ["train.max_steps=3", "train.save_interval=0"])
    line = error_line(second)
    assert f"{save_dir / LOCK_NAME}: another run trains in this train.save_dir (pid" in line
    go.touch()  # the first run goes on
    ((code, _, stderr),) = finish(first)
    assert code == 0, stderr[-3000:]
    assert [r["step"] for r in records(save_dir)] == [1, 2, 3]
    assert not (save_dir / LOCK_NAME).exists()


# --------------------------------------------------------------------------------------------
# The vocabulary travels with the checkpoint
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("misuse_corpus")
    make_opus(root / "raw", {"de": (300, 20, 20)})
    return root


def test_resume_after_repreprocessing_with_another_vocabulary_is_refused(corpus, tmp_path):
    data = tmp_path / "data"
    run_preprocess(corpus / "raw", data, ["de"], max_len=40)
    save_dir = tmp_path / "run"
    data_args = [f"data.dataset={data}", "model.vocab_size=null", "data.max_length=40"]
    (result,) = train(save_dir, [*data_args, "train.max_steps=1"])
    assert result[0] == 0, result[2][-3000:]
    tag = save_dir / "global_step1"
    info = json.loads((tag / "train_config.json").read_text())
    assert info["vocab"]["spm_sha256"] == ckpt.sha256_file(data / "spm.model")
    assert ckpt.sha256_file(tag / "spm.model") == info["vocab"]["spm_sha256"]
    assert "spm.model" in json.loads((tag / ckpt.MANIFEST).read_text())["files"]
    # The same DATA_DIR preprocessed again with another SentencePiece model, same size.
    run_preprocess(corpus / "raw", data, ["de"], max_len=40, model_type="bpe", overwrite=True)
    assert ckpt.sha256_file(data / "spm.model") != info["vocab"]["spm_sha256"]
    (result,) = train(save_dir, [*data_args, "train.max_steps=2"])
    line = error_line(result)
    assert f"config key data.dataset: {data / 'spm.model'} is not the vocabulary" in line


# --------------------------------------------------------------------------------------------
# One line and exit 2 instead of a traceback
# --------------------------------------------------------------------------------------------


def test_missing_and_damaged_data_directories(tmp_path, corpus):
    (result,) = train(tmp_path / "r1", [f"data.dataset={tmp_path / 'nowhere'}"])
    assert "nowhere/manifest.json" in error_line(result)
    data = tmp_path / "data"
    run_preprocess(corpus / "raw", data, ["de"], max_len=40)
    train_bin = data / "bin" / "train.de-en.de.bin"
    train_bin.write_bytes(train_bin.read_bytes()[:7])  # truncated
    (result,) = train(tmp_path / "r2", [f"data.dataset={data}", "model.vocab_size=null"])
    assert str(train_bin) in error_line(result)


def test_unwritable_save_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a file where a directory is expected")
    (result,) = train(blocker / "run", [])
    line = error_line(result)
    assert line.startswith("error: config key train.save_dir: cannot write there:")
    assert str(blocker) in line


@pytest.mark.parametrize(
    ("content", "match"),
    [
        ('{"zero_optimization": {"stage": "one"}}', "zero_optimization.stage must be an integer"),
        ('{"zero_optimization": {"stage": 7}}', "zero_optimization.stage must be 0, 1, 2 or 3"),
        ('{"fp16": true}', "key fp16 must be an object"),
        ('{"bf16": {"enabled": "yes"}}', "bf16.enabled must be true or false"),
        ('{"steps_per_print": "often"}', "key steps_per_print must be an integer"),
        ('{"fp16": {"loss_scale": NaN}}', "fp16.loss_scale must be a finite number"),
        ('{"zero_optimization": {"stage": 1, "reduce_bucket_size": "big"}}', "DeepSpeed rejects"),
    ],
)
def test_deepspeed_json_with_a_wrong_type(tmp_path, content, match):
    ds = tmp_path / "ds.json"
    ds.write_text(content)
    (result,) = train(tmp_path / "run", [f"train.deepspeed_config={ds}", "train.max_steps=1"])
    line = error_line(result)
    assert match in line and str(ds) in line


@pytest.mark.parametrize(
    "override",
    ["train.lr=.nan", "train.lr=.inf", "model.layernorm_eps=1e999", "train.clip_grad=-.inf"],
)
def test_non_finite_numbers_are_refused(override, tmp_path):
    """As an override (YAML 1.1's .nan/.inf are not plain decimals; 1e999 overflows) and as a
    config file's value (YAML reads .nan and .inf there)."""
    key, value = override.split("=")
    with pytest.raises(ConfigError, match=f"config key {key}: (must be a finite number|expected float)"):  # fmt: skip
        load_config("tiny_cpu", [override])
    section, name = key.split(".")
    data = yaml.safe_load((ROOT / "megatron_branchnorm" / "configs" / "tiny_cpu.yaml").read_text())
    data.setdefault(section, {})[name] = "__VALUE__"
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data).replace("__VALUE__", value))
    with pytest.raises(ConfigError, match=f"config key {key}: must be a finite number"):
        load_config(str(path))


@pytest.mark.parametrize(
    ("override", "match"),
    [
        ("model.hidden_size=99999999999999", "out of range"),
        ("train.seed=-1", "must be >= 0"),
        ("train.max_steps=1e3", "expected int"),
    ],
)
def test_out_of_range_numbers_are_refused(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny_cpu", [override])


def test_yaml_alias_bomb_is_bounded(tmp_path):
    """418 bytes that expand to 10^9 nodes: refused in milliseconds with a short message."""
    lines = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i in range(1, 10):
        prev, cur = chr(ord("a") + i - 1), chr(ord("a") + i)
        lines.append(f"{cur}: &{cur} [" + ", ".join(f"*{prev}" for _ in range(10)) + "]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(lines) + "\n")
    t0 = time.time()
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert time.time() - t0 < 2
    assert "expands to more than" in str(info.value) and len(str(info.value)) < 300
    # the same through a key=value override on the command line
    nested = "[1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"
    for name in "abcde":
        nested = f"&{name} {nested}, [" + ", ".join(f"*{name}" for _ in range(10)) + "]"
        nested = f"[{nested}]"
    # an override's value is read by its key's type, never as YAML: a string key takes the
    # text literally (no expansion), refused here as an unknown activation, quoted short
    with pytest.raises(ConfigError, match="config key model.activation: unknown activation") as info:  # fmt: skip
        load_config("tiny_cpu", [f"model.activation={nested}"])
    assert len(str(info.value)) < 400


def test_error_messages_quote_at_most_a_few_hundred_characters():
    with pytest.raises(ConfigError) as info:
        load_config("tiny_cpu", ["model.activation=" + "x" * 100_000])
    with pytest.raises(ConfigError) as info2:
        load_config("tiny_cpu", ["model.hidden_size=" + "'" + "y" * 100_000 + "'"])
    assert len(str(info.value)) < 400 and len(str(info2.value)) < 400


@pytest.mark.parametrize("phase", ["engine:rank1", "manifest", "metrics"])
def test_full_disk_ends_every_rank_with_one_line(tmp_path, phase):
    """ENOSPC on one rank (test-only emulation, MBN_FAULT_INJECT=enospc@...): every rank exits
    2 with the same line; the failed checkpoint has no manifest and ``latest`` is unmoved."""
    save_dir = tmp_path / "run"
    results = train(
        save_dir,
        ["train.max_steps=3", "train.save_interval=2"],
        world=2,
        fault=f"enospc@{phase}",
    )
    lines = [error_line(r) for r in results]
    assert lines[0] == lines[1]
    assert "no space left on device" in lines[0]
    if phase == "metrics":
        assert "cannot write metrics" in lines[0] and ckpt.read_latest(save_dir) is None
    else:
        assert "checkpoint" in lines[0] and "global_step2" in lines[0]
        assert not (save_dir / "global_step2" / ckpt.MANIFEST).exists()
        assert ckpt.read_latest(save_dir) is None
    assert not (save_dir / LOCK_NAME).exists()


def test_ctrl_c_leaves_no_traceback_and_nothing_complete_half_written(tmp_path):
    save_dir = tmp_path / "run"
    (proc,) = start(save_dir, ["train.max_steps=50", "train.save_interval=1"], fault="slow@0.5")
    deadline = time.time() + 240
    while len(records(save_dir)) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    ((code, _, stderr),) = finish([proc])
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    assert "interrupted (Ctrl-C)" in stderr
    complete, _ = ckpt.checkpoint_tags(save_dir)
    for tag in complete:
        ckpt.verify_checkpoint(save_dir / tag)
    assert ckpt.read_latest(save_dir) in complete
    assert not (save_dir / LOCK_NAME).exists()


def test_a_real_full_disk_ends_every_rank_with_one_line(tmp_path):
    """The same on a 160 KiB tmpfs: torch.save reports ENOSPC as a RuntimeError from its zip
    writer, which the emulation above cannot show. Needs mount(2) (root in the test VM)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=160k", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        save_dir = disk / "run"
        results = train(save_dir, ["train.max_steps=3", "train.save_interval=1"], world=2)
        lines = [error_line(r) for r in results]
        assert lines[0] == lines[1]
        assert "global_step1 not saved" in lines[0] and "no space left on device" in lines[0]
        assert ckpt.read_latest(save_dir) is None
        assert not (save_dir / "global_step1" / ckpt.MANIFEST).exists()
    finally:
        subprocess.run(["umount", str(disk)], check=False)


def test_a_bad_thread_count_in_the_environment(tmp_path):
    env = {**rank_env(0, 1, None), "OMP_NUM_THREADS": "abc"}
    args = [sys.executable, TRAIN, "--config", "tiny_cpu", f"train.save_dir={tmp_path / 'r'}"]
    done = subprocess.run(args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=300)
    line = error_line((done.returncode, done.stdout, done.stderr))
    assert "environment variable OMP_NUM_THREADS: expected a count >= 1, got 'abc'" in line
