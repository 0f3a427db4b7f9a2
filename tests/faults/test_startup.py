"""A rank while it starts (items 6, 7 and 12b; stop_signals, training/environment).

- A rendezvous that cannot complete (rank 1 with no rank 0 at MASTER_ADDR:MASTER_PORT, rank 0
  with no rank 1) ends within ``train.collective_timeout_s`` with one line naming the address,
  exit 4; before, rank 1 waited twice that inside C++ and rank 0 ended in a traceback.
- SIGTERM while the rank is inside gloo's C++ rendezvous ends it at once, one line, exit 75;
  before, the signal was only recorded and the rank waited out the rendezvous.
- A rank whose launcher, or whose launcher's ``deepspeed`` command, is gone before its first
  instruction stops there in one line instead of training with nobody to stop it.
- DeepSpeed's CPU op build stopped under a rank (its launcher stopping the job after another
  rank was lost) is one line and exit 4, not ninja's traceback; a build lock left by a rank
  killed while building no longer makes every start wait for it forever.

Only loopback addresses; every rank here ends before it trains (a world of 1, or 2 with one
rank started).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from megatron_branchnorm.runner.launch import RENDEZVOUS_FD, HeldPort, rank_env
from megatron_branchnorm.training import stop_signals
from megatron_branchnorm.training.exit_codes import PEER_LOST_EXIT_CODE, REQUEUE_EXIT_CODE
from tests.faults.common import TRAIN
from tests.pipeline.conftest import ROOT

pytestmark = pytest.mark.faults

TIMEOUT_S = 2  # train.collective_timeout_s of the ranks that must time out


def _rank(
    save_dir: Path, rank: int, world: int, held: HeldPort | None, timeout_s: float, **env: str
):
    """train.py as rank ``rank`` of ``world`` at 127.0.0.1:``held.port``, started now (rank 0
    hosts the store on the held socket, as under start_ranks; None: a world of one that hosts
    its own)."""
    cmd = [
        sys.executable, TRAIN, "--config", "tiny_cpu", "train.max_steps=1",
        f"train.collective_timeout_s={timeout_s}", f"train.save_dir={save_dir}",
    ]  # fmt: skip
    environ = {**rank_env(rank, world, held and held.port), "OMP_NUM_THREADS": "1", **env}
    fds = (held.fileno(),) if held is not None and rank == 0 else ()
    if fds:
        environ[RENDEZVOUS_FD] = str(fds[0])
    return subprocess.Popen(
        cmd, cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        pass_fds=fds,
    )  # fmt: skip


def _joined(port: int) -> bool:
    """Whether a connection to TCP ``port`` of this machine is established (rank 0 joining the
    rendezvous store it hosts there: nothing else connects to it)."""
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            local, state = row.split()[1], row.split()[3]
            if state == "01" and int(local.rpartition(":")[2], 16) == port:
                return True
    return False


def _lines(stderr: str) -> list[str]:
    """Our lines on stderr: c10d's C++ log lines and their stack frames, and DeepSpeed's
    logger lines (``[2026-11-27 04:20:25,760] [WARNING] ...``), left out."""
    logged = ("[W", "[E", "[I", "frame #", "Exception raised from", "<omitting", "[20")
    return [ln for ln in stderr.splitlines() if ln.strip() and not ln.startswith(logged)]


@pytest.fixture(scope="module")
def starting_ranks(tmp_path_factory) -> dict[str, tuple[int, str]]:
    """The ranks that end while starting, run side by side; (exit code, stderr) of each."""
    base = tmp_path_factory.mktemp("startup")
    extensions = base / "torch_extensions"
    lock = extensions / "deepspeed_shm_comm" / "lock"  # torch's layout under TORCH_EXTENSIONS_DIR
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (time.time() - 3600, time.time() - 3600))  # left by a build killed an hour ago
    # held here until every rank has ended; no_master's queues its connection, nobody answers
    with HeldPort() as no_master, HeldPort() as no_peer, HeldPort() as term_port:
        procs = {
            "no_master": _rank(base / "a", 1, 2, no_master, TIMEOUT_S),
            "no_peer": _rank(base / "b", 0, 2, no_peer, TIMEOUT_S),
            # only the signal can end this one in time: its rendezvous would wait 120 s
            "sigterm": _rank(base / "c", 0, 2, term_port, 120),
            "stale_lock": _rank(
                base / "d", 0, 1, None, TIMEOUT_S, TORCH_EXTENSIONS_DIR=str(extensions)
            ),
        }
        term = procs["sigterm"]
        while not _joined(term_port.port) and term.poll() is None:  # inside the C++ rendezvous
            time.sleep(0.05)
        term.send_signal(signal.SIGTERM)
        out = {}
        for name, proc in procs.items():
            try:
                _, stderr = proc.communicate(timeout=90)
            except subprocess.TimeoutExpired:
                proc.kill()
                _, stderr = proc.communicate()
            out[name] = (proc.returncode, stderr)
    return out


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("no_master", "rank 0 could not be reached there"),
        ("no_peer", "rank 0 listens there, and not all 2 ranks connected"),
    ],
)
def test_a_rendezvous_that_cannot_complete_ends_in_one_line(starting_ranks, name, expected):
    code, stderr = starting_ranks[name]
    lines = _lines(stderr)
    assert code == PEER_LOST_EXIT_CODE and len(lines) == 1, stderr[-3000:]
    assert lines[0].startswith("error: rank ") and "127.0.0.1:" in lines[0], lines
    assert f"did not complete within {TIMEOUT_S} s (train.collective_timeout_s)" in lines[0]
    assert expected in lines[0], lines


def test_sigterm_inside_the_rendezvous_ends_the_rank_at_once(starting_ranks):
    code, stderr = starting_ranks["sigterm"]
    assert code == REQUEUE_EXIT_CODE, stderr[-3000:]
    assert _lines(stderr) == [
        "rank 0: SIGTERM while starting, before the first update: nothing to save, exiting 75"
    ], stderr[-3000:]


def test_a_build_lock_left_by_a_killed_build_is_said_at_once_then_ends_the_wait(starting_ranks):
    code, stderr = starting_ranks["stale_lock"]
    lines = _lines(stderr)
    assert code == PEER_LOST_EXIT_CODE and len(lines) == 2, stderr[-3000:]
    assert "deepspeed_shm_comm/lock exists, 36" in lines[0], lines  # before the wait
    assert "deepspeed_shm_comm/lock, held for" in lines[1], lines
    assert "no process of this node builds there" in lines[1], lines


# The launcher gone before the rank's first instruction. A helper adopts the orphans
# (PR_SET_CHILD_SUBREAPER, as init or systemd would) and reports the exit code of the last
# process to end: the rank, or the fake launcher that passes the rank's code on. The rank waits
# on a pipe (its stdin) that only the process that must be gone holds open, so it starts once
# that process has ended: an event, no delay.
GATE = "import os, sys; os.read(0, 1); os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
START_AND_EXIT = """
import os, subprocess, sys
gate, _held = os.pipe()  # _held closes when this process ends
subprocess.Popen(sys.argv[2:], stdin=gate)
os._exit(0)
"""
LAUNCHER = "import subprocess, sys; sys.exit(subprocess.run(sys.argv[2:]).returncode)"
HELPER = """
import ctypes, json, os, subprocess, sys
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
cmd, env, err = json.loads(sys.argv[1])
with open(err, "w") as out:  # the rank's stdout too: this process's own is the result
    subprocess.Popen(cmd, env=env, stdout=out, stderr=out, start_new_session=True)
last = None
while True:
    try:
        _, status = os.wait()
    except ChildProcessError:
        break
    last = os.waitstatus_to_exitcode(status)
print(json.dumps(last))
"""


def _orphaned_rank(tmp_path: Path, what_goes: str) -> tuple[int, str]:
    """A rank of world 1 with a launcher's environment whose launcher (``launcher``) or
    whose launcher's parent (``command``) ended before the rank began."""
    rank = [
        sys.executable, "-c", GATE, TRAIN, "--config", "tiny_cpu",
        "train.max_steps=1", f"train.save_dir={tmp_path / 'run'}",
    ]  # fmt: skip
    fake = "deepspeed.launcher.launch"  # what the watch looks for in a parent's command line
    if what_goes == "launcher":  # the launcher starts the rank and ends
        cmd = [sys.executable, "-c", START_AND_EXIT, fake, *rank]
    else:  # the deepspeed command starts the launcher and ends; the launcher waits on
        cmd = [sys.executable, "-c", START_AND_EXIT, "deepspeed", sys.executable]
        cmd += ["-c", LAUNCHER, fake, *rank]
    env = {**rank_env(0, 1, None), "CROSS_RANK": "0", "CROSS_SIZE": "1"}
    err = tmp_path / "stderr"
    helper = subprocess.run(
        [sys.executable, "-c", HELPER, json.dumps([cmd, env, str(err)])],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=True,
    )  # fmt: skip
    return json.loads(helper.stdout), err.read_text()


@pytest.mark.parametrize("what_goes", ["launcher", "command"])
def test_a_rank_whose_launcher_is_gone_at_start_stops_in_one_line(tmp_path, what_goes):
    code, stderr = _orphaned_rank(tmp_path, what_goes)
    lines = _lines(stderr)
    assert code == REQUEUE_EXIT_CODE and len(lines) == 1, stderr[-3000:]
    gone = "DeepSpeed's launcher" if what_goes == "launcher" else "the deepspeed command"
    assert lines[0].startswith(f"rank 0: {gone}"), lines
    assert lines[0].endswith("stopping before the first update (nothing to save), exiting 75")
    if what_goes == "launcher":  # stopped at its first instruction: nothing was written
        assert not (tmp_path / "run").exists()


# DeepSpeed's CPU op build stopped under the rank (reproduced with the real launcher: kill -9
# of the rank waiting for the build; the launcher then terminates the survivor's process tree,
# ninja first, which raised exactly this). In-process: the build raises it.
NINJA_STOPPED = "Error building extension 'deepspeed_shm_comm': ninja: build stopped: interrupted by user."  # fmt: skip


def _patch_build(monkeypatch, message: str, returncode: int) -> None:
    from deepspeed.accelerator import get_accelerator

    from megatron_branchnorm.training import environment

    def load(self, verbose=False):
        try:
            raise subprocess.CalledProcessError(returncode, ["ninja", "-v"])
        except subprocess.CalledProcessError as exc:
            raise RuntimeError(message) from exc

    builder = type(get_accelerator().create_op_builder("ShareMemCommBuilder"))
    monkeypatch.setattr(builder, "load", load)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    for key, value in environment.own_rendezvous().items():  # a store this process holds
        monkeypatch.setenv(key, value)


class _Starting:
    """A Trainer reduced to its process group (training.trainer.run's view of it)."""

    def __init__(self, cfg) -> None:
        from megatron_branchnorm.training import environment

        environment.init_process_group(60.0)

    def train(self) -> int:
        raise AssertionError("the process group cannot have started")


def test_a_build_stopped_under_the_rank_is_a_lost_peer(monkeypatch, capsys, tmp_path):
    from megatron_branchnorm.training import trainer

    _patch_build(monkeypatch, NINJA_STOPPED, 2)
    monkeypatch.setattr(trainer, "Trainer", _Starting)
    cfg = SimpleNamespace(train=SimpleNamespace(save_dir=str(tmp_path)))
    assert trainer.run(cfg) == PEER_LOST_EXIT_CODE
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: rank 0: DeepSpeed's CPU communication op"), err
    assert "another rank, or its node, is gone" in err[0] and "interrupted by user" in err[0]
    assert err[0].endswith("resubmit the job to resume from the start (no checkpoint yet)")


def test_a_build_stopped_by_the_ranks_own_sigterm_is_that_stop(monkeypatch):
    from megatron_branchnorm.training import environment

    stops = []

    def stop_now(line, code):
        stops.append((line, code))
        raise SystemExit(code)

    _patch_build(monkeypatch, NINJA_STOPPED, 2)
    monkeypatch.setattr(stop_signals, "stop_now", stop_now)
    monkeypatch.setattr(stop_signals, "_starting", True)
    monkeypatch.setattr(stop_signals, "_received", signal.SIGTERM)
    with pytest.raises(SystemExit):
        environment.load_shm_comm_op(60.0)
    assert stops == [
        ("rank 0: SIGTERM while starting, before the first update: nothing to save, exiting 75", 75)
    ]


def test_a_build_that_fails_is_not_taken_for_a_lost_peer(monkeypatch):
    from megatron_branchnorm.training import environment

    _patch_build(monkeypatch, "Error building extension 'deepspeed_shm_comm': shm.cpp:1: error", 1)
    with pytest.raises(RuntimeError, match="shm.cpp:1: error") as caught:
        environment.load_shm_comm_op(60.0)
    assert not environment.peer_lost(caught.value)


def test_install_puts_its_handlers_back_after_someone_replaced_them():
    """A second install (a Trainer built in a process whose tests put their own handlers back)
    takes the stop signals again: a module that only remembered being installed left SIGUSR1's
    default action, which killed the whole pytest process at the next in-process signal."""
    saved = {sig: signal.getsignal(sig) for sig in (*stop_signals.STOP_SIGNALS, signal.SIGINT)}
    try:
        stop_signals.install()
        for sig in stop_signals.STOP_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        stop_signals.install()
        assert all(
            signal.getsignal(sig) is stop_signals._record for sig in stop_signals.STOP_SIGNALS
        )
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


@pytest.mark.parametrize("beside", [True, False])
def test_the_op_is_built_with_the_ninja_beside_the_interpreter(monkeypatch, tmp_path, beside):
    """A rank started as ``.venv/bin/python train.py`` (the system's ninja first on PATH) and one
    started by the deepspeed launcher (the virtualenv's first) build with the same ninja: two
    versions take each other's build log for a changed command and rebuild the op from scratch."""
    from megatron_branchnorm.training import environment

    bin_dir = tmp_path / "venv" / "bin"
    bin_dir.mkdir(parents=True)
    if beside:
        (bin_dir / "ninja").write_text("#!/bin/sh\n")
    monkeypatch.setattr(environment.sys, "executable", str(bin_dir / "python"))
    _patch_build(monkeypatch, "unused", 0)
    monkeypatch.setenv("PATH", "/usr/bin:/bin")
    seen = []
    monkeypatch.setattr(
        environment, "load_op", lambda builder, timeout_s: seen.append(os.environ["PATH"])
    )
    environment.setup_process_env()  # what a rank does first, then the build
    environment.load_shm_comm_op(60.0)
    assert seen == [f"{bin_dir}:/usr/bin:/bin" if beside else "/usr/bin:/bin"]
