"""runner/ranks.py: R local ranks with srun's environment, a log each, reaped, signalled and
killed as a group."""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Callable

from megatron_branchnorm.runner.ranks import start_ranks, wait_ranks


def until(event: Callable[[], bool], timeout_s: float = 60.0) -> None:
    """Wait for ``event`` (polled), failing after ``timeout_s``: an event, not a delay."""
    deadline = time.monotonic() + timeout_s
    while not event():
        assert time.monotonic() < deadline, "the event never came"
        time.sleep(0.01)


ECHO = "import os, sys; print(os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'], os.environ.get('EXTRA'), sys.argv[1:])"
SLEEPER = "import signal, sys, time\nsignal.signal(signal.SIGUSR1, lambda *a: sys.exit(75))\nprint('ready', flush=True)\nwhile True: time.sleep(0.01)"


def test_each_rank_gets_its_environment_and_log(tmp_path):
    ranks = start_ranks(3, ["-c", ECHO, "x"], tmp_path, module=None, env={"EXTRA": "e"})
    assert ranks.wait(timeout=60) == [0, 0, 0]
    for r in range(3):
        rank, world, port, extra, args = (tmp_path / f"rank{r}.log").read_text().split(" ", 4)
        assert (rank, world, port, extra) == (str(r), "3", str(ranks.port), "e")
        assert "['x']" in args
    assert ranks.argv[:2] == [sys.executable, "-c"]


def test_poll_reaps_and_keeps_maxrss(tmp_path):
    with start_ranks(2, ["-c", "pass"], tmp_path, module=None) as ranks:
        until(lambda: None not in ranks.poll())
    assert ranks.codes == [0, 0]
    assert all(m and m > 1 for m in ranks.maxrss_mb)


def test_signal_and_pipe_rank0(tmp_path):
    with start_ranks(2, ["-c", SLEEPER], tmp_path, module=None, pipe_rank0=True) as ranks:
        assert ranks[0].stdout.readline() == "ready\n"
        ranks.sample_peaks()
        assert ranks.peak_rss_mb[0] is not None
        until(lambda: "ready" in (tmp_path / "rank1.log").read_text())
        ranks.send(signal.SIGUSR1)
        assert ranks.wait(timeout=60) == [75, 75]


def test_leaving_the_block_kills_the_ranks(tmp_path):
    try:
        with start_ranks(2, ["-c", SLEEPER], tmp_path, module=None) as ranks:
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert [p.returncode for p in ranks] == [-signal.SIGKILL] * 2


def test_append_mode_and_module(tmp_path):
    (tmp_path / "rank0.log").write_text("before\n")
    ranks = start_ranks(1, ["--version"], tmp_path, module="pip", mode="a")
    assert wait_ranks(ranks.procs, timeout=120) == [0]
    text = (tmp_path / "rank0.log").read_text()
    assert text.startswith("before\n") and "pip" in text


def test_pipes_apart_without_a_log_dir_and_log_prefix(tmp_path):
    two = "import sys; print('out'); print('err', file=sys.stderr)"
    ranks = start_ranks(2, ["-c", two], None, module=None)
    assert ranks.logs == []
    assert [p.communicate(timeout=60) for p in ranks] == [("out\n", "err\n")] * 2
    ranks = start_ranks(1, ["-c", ECHO], tmp_path, module=None, log_prefix="run.")
    assert ranks.wait(timeout=60) == [0]
    assert (tmp_path / "run.rank0.log").read_text().startswith("0 1 ")
