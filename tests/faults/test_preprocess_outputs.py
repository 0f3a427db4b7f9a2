"""What preprocess writes besides its DATA_DIR, what a killed
run leaves, and markers that are not small regular files.

- ``--stats FILE`` follows ``--output``'s rules (cli.check_output_file with a recogniser):
  never over or inside the input or the output, never inside a directory of a known kind,
  never over an existing file that is not a stats file of ours, writable, all checked before
  any work; and written before the DATA_DIR is published, so a failed write leaves no output.
- A run killed by SIGKILL takes its SentencePiece trainer with it (PR_SET_PDEATHSIG), and the
  next run of the same output removes the temporary directory it left, in one line, but never
  a live run's, another host's, or a directory without our temporary marker.
- A marker, ``latest``, ``manifest.json``, ``metrics.jsonl`` or any JSON record of ours that is
  a device, a FIFO, a directory or too large is refused with one line naming it (or not
  recognised as ours), never read without end (formats/files.read_small_file).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from megatron_branchnorm.commands import preprocess as preprocess_cmd
from megatron_branchnorm.data import staging
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.formats.data_dir import DataError, read_data_manifest
from megatron_branchnorm.formats.files import FileShapeError, read_small_file
from megatron_branchnorm.formats.outputs import make_temp_dir, remove_dead_temp_dirs
from megatron_branchnorm.training import run_lock
from tests.data.conftest import make_opus

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "preprocess_data.py"
BOUND_S = 60.0
"""Longest wait for an event (a process to end, a file to appear) before the test fails."""


def argv(raw: Path, out: Path, *extra: object) -> list[str]:
    return [
        *("--format", "opus100", "--input", raw, "--langs", "de", "--output", out),
        *("--vocab-size", "100", "--character-coverage", "1.0", "--workers", "1"),
        *("--no-progress", *extra),
    ]  # fmt: skip


def call(capsys, args: list) -> tuple[int, str]:
    """(exit code, stderr) of preprocess_data.py's main in this process."""
    code = preprocess_cmd.main([str(a) for a in args])
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *needles: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def temporaries(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name)


@pytest.fixture
def raw(tmp_path: Path) -> Path:
    make_opus(tmp_path / "raw", {"de": (60, 5, 5)})
    return tmp_path / "raw"


# --------------------------------------------------------------------------------------------
# Item 4: --stats never eats what preprocess did not write
# --------------------------------------------------------------------------------------------


def _stats_target(case: str, tmp: Path, raw: Path, out: Path) -> tuple[Path, str]:
    """(--stats path, what the error says) for each way --stats could destroy something."""
    corpus_file = next(raw.rglob("*-train.de"))
    other = tmp / "other_data"
    other.mkdir()
    dirs.write_marker(other, "preprocess_data", "data")
    (other / "manifest.json").write_text('{"format": "megatron_branchnorm-data"}\n')
    run = tmp / "run"
    (run / "global_step4").mkdir(parents=True)
    dirs.write_marker(run, "train", "run")
    export = tmp / "old_export"
    export.mkdir()
    (export / "export.json").write_text('{"format": "megatron_branchnorm-export"}\n')
    users = tmp / "notes.txt"
    users.write_text("my notes\n")
    link = tmp / "link.json"
    link.symlink_to(users)
    return {
        "input_file": (corpus_file, "lies inside --input"),
        "output_itself": (out, "is the same path as --output"),
        "inside_output": (out / "stats.json", "lies inside --output"),
        "other_data_dir_manifest": (other / "manifest.json", "a DATA_DIR written by preprocess"),
        "new_file_in_a_run": (run / "stats.json", "a run directory"),
        "new_file_in_a_run_tag": (run / "global_step4" / "s.json", "a run directory"),
        "older_export": (export / "stats.json", "an export written by convert"),
        "users_file": (users, "exists and is not a --stats file"),
        "link_to_users_file": (link, "exists and is not a --stats file"),
    }[case]


@pytest.mark.parametrize(
    "case",
    [
        "input_file",
        "output_itself",
        "inside_output",
        "other_data_dir_manifest",
        "new_file_in_a_run",
        "new_file_in_a_run_tag",
        "older_export",
        "users_file",
        "link_to_users_file",
    ],
)
def test_stats_never_replaces_what_preprocess_did_not_write(capsys, tmp_path, raw, case):
    """``--stats`` onto a corpus file broke the next run (line counts differ); onto another
    DATA_DIR's manifest.json it destroyed that DATA_DIR. Now each is refused before any work:
    nothing is written, no output and no temporary directory appear."""
    out = tmp_path / "data"
    stats, says = _stats_target(case, tmp_path, raw, out)
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    code, err = call(capsys, argv(raw, out, "--stats", stats))
    one_line(code, err, f"--stats {stats}", says)
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    assert not out.exists() and temporaries(tmp_path) == []


def test_stats_unwritable_is_refused_before_any_work(capsys, tmp_path, raw):
    """An unwritable --stats used to fail only after the DATA_DIR was published."""
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    for where in (locked, Path("/sys")):  # root writes anywhere, but not into sysfs
        try:
            tempfile.NamedTemporaryFile(dir=where).close()
        except OSError:
            break
    else:
        pytest.skip("no directory this user cannot write")
    stats = where / "megatron_branchnorm_stats.json"
    out = tmp_path / "data"
    code, err = call(capsys, argv(raw, out, "--stats", stats))
    one_line(code, err, f"--stats {stats}: cannot write")
    assert not out.exists() and temporaries(tmp_path) == []


def test_stats_that_fails_to_write_publishes_no_output(capsys, tmp_path, raw):
    """A write that fails even so (a full device) leaves no DATA_DIR behind."""
    out = tmp_path / "data"
    code, err = call(capsys, argv(raw, out, "--stats", "/dev/full"))
    one_line(code, err, "--stats /dev/full: cannot write (no space left on device)")
    assert not out.exists() and temporaries(tmp_path) == []


def test_stats_replaces_its_own_file_and_writes_devices_in_place(capsys, tmp_path, raw):
    stats = tmp_path / "stats.json"
    for i in range(2):  # the second run replaces the first run's stats file
        code, err = call(capsys, argv(raw, tmp_path / f"data{i}", "--stats", stats))
        assert code == 0, err
        assert set(json.loads(stats.read_text())) == staging.STATS_KEYS
    link = tmp_path / "link.json"
    link.symlink_to(stats)
    code, err = call(capsys, argv(raw, tmp_path / "data2", "--stats", link))
    assert code == 0, err
    assert link.is_symlink() and staging.is_stats_file(stats)
    code, err = call(capsys, argv(raw, tmp_path / "data3", "--stats", os.devnull))
    assert code == 0, err
    assert Path(os.devnull).is_char_device()


# --------------------------------------------------------------------------------------------
# Item 13: a killed run's SentencePiece trainer and temporary directory
# --------------------------------------------------------------------------------------------

# tools/preprocess_data.py with the SentencePiece trainer's work replaced by a wait: the child
# process is the real one (started by the real pool, in the real temporary directory), but
# training a tiny model takes milliseconds, too short to catch it running.
BLOCKED_TRAINER = """
import os, signal, sys
from pathlib import Path
from megatron_branchnorm.commands import preprocess as cmd
from megatron_branchnorm.data import preprocess as pp

def _train_spm(*args):
    Path(sys.argv[1]).write_text(str(os.getpid()))
    while True:
        signal.pause()

pp._train_spm = _train_spm
sys.exit(cmd.main(sys.argv[2:]))
"""

# A live process holding a temporary directory of the output named in argv[1].
LIVE_HOLDER = """
import sys
from pathlib import Path
from megatron_branchnorm.formats.outputs import make_temp_dir
print(make_temp_dir(Path(sys.argv[1]), "preprocess_data"), flush=True)
sys.stdin.read()
"""


def wait_for(what: str, done) -> None:
    """Poll ``done()`` until it is true; fail after :data:`BOUND_S`."""
    deadline = time.monotonic() + BOUND_S
    while not done():
        assert time.monotonic() < deadline, f"waited {BOUND_S:.0f} s for {what}"
        time.sleep(0.01)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_killed_run_takes_its_trainer_along_and_the_rerun_removes_its_temporary(tmp_path, raw):
    out = tmp_path / "data"
    ready = tmp_path / "trainer.pid"
    run = subprocess.Popen(
        [sys.executable, "-c", BLOCKED_TRAINER, str(ready), *map(str, argv(raw, out))],
        stderr=subprocess.PIPE,
    )
    trainer = None
    holder = None
    try:
        wait_for("the SentencePiece child", lambda: ready.exists() and ready.read_text())
        trainer = int(ready.read_text())
        (dead_tmp,) = [p for p in tmp_path.iterdir() if p.name.startswith(".data.tmp-")]
        assert psutil.Process(trainer).ppid() == run.pid
        assert (dead_tmp / "spill").is_dir()
        run.kill()
        run.wait()
        wait_for(f"the trainer {trainer} to end with its parent", lambda: gone(trainer))
        trainer = None

        holder = subprocess.Popen(
            [sys.executable, "-c", LIVE_HOLDER, str(out)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        live_tmp = Path(holder.stdout.readline().strip())
        assert live_tmp.is_dir()

        res = subprocess.run(
            [sys.executable, str(TOOL), *map(str, argv(raw, out))], capture_output=True, text=True
        )
        assert res.returncode == 0, res.stderr[-3000:]
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1, res.stderr
        assert lines[0].startswith(f"removed what dead runs of {out} left: {dead_tmp.name} (")
        assert f"its process {run.pid} no longer runs" in lines[0]
        assert live_tmp.name not in lines[0]
        assert not dead_tmp.exists() and live_tmp.is_dir()
        assert (out / "manifest.json").is_file() and not (out / dirs.TEMP_MARKER).exists()
    finally:
        if trainer is not None and not gone(trainer):
            os.kill(trainer, signal.SIGKILL)
        run.kill()
        run.wait()
        if holder is not None:
            holder.communicate("")
    # The holder has ended: its temporary directory is now a dead run's.
    assert remove_dead_temp_dirs(out) == [
        f"{live_tmp.name} (0.0 MB; its process {holder.pid} no longer runs on "
        f"{run_lock.owner_record()['host']})"
    ]
    assert temporaries(tmp_path) == []


def test_only_marked_temporaries_of_dead_runs_of_this_output_are_removed(tmp_path):
    """Pid reuse counts as dead; this process's own, another host's, another output's, an
    unmarked directory and a marker that is a link all stay."""
    out = tmp_path / "data"
    me = run_lock.owner_record()

    def temp(name: str, owner: dict, output: str = "data") -> Path:
        path = tmp_path / f".data.tmp-{name}"
        path.mkdir()
        dirs.write_temp_marker(path, "preprocess_data", output, owner)
        return path

    reused = temp("reused", {**me, "pid": os.getppid(), "pid_start": "1"})
    mine = make_temp_dir(out, "preprocess_data")
    elsewhere = temp("elsewhere", {**me, "host": "another-host", "pid": 2**22 + 1})
    other_output = temp("other", {**me, "pid": 2**22 + 1}, output="data2")
    unmarked = tmp_path / ".data.tmp-123"
    unmarked.mkdir()
    linked = tmp_path / ".data.tmp-linked"
    linked.mkdir()
    (linked / dirs.TEMP_MARKER).symlink_to(reused / dirs.TEMP_MARKER)
    (removed,) = remove_dead_temp_dirs(out)
    assert removed.startswith(f"{reused.name} (0.0 MB; its process {os.getppid()} no longer")
    assert not reused.exists()
    for kept in (mine, elsewhere, other_output, unmarked, linked):
        assert kept.is_dir(), kept


# --------------------------------------------------------------------------------------------
# Item 12d: markers and small files of ours that are not small regular files
# --------------------------------------------------------------------------------------------


def _not_regular(path: Path, how: str) -> None:
    """Make ``path`` a link to a device, a FIFO, a directory, or a file too large."""
    if how == "link_to_dev_zero":
        path.symlink_to("/dev/zero")
    elif how == "fifo":
        os.mkfifo(path)
    elif how == "directory":
        path.mkdir()
    else:
        with open(path, "wb") as f:
            f.truncate(100 << 20)


HOWS = ["link_to_dev_zero", "fifo", "directory", "huge"]


@pytest.mark.parametrize("how", HOWS)
def test_a_marker_that_is_not_a_small_regular_file_is_refused(capsys, tmp_path, raw, how):
    """A marker linked to /dev/zero was read without end (MemoryError); a FIFO blocked."""
    out = tmp_path / "data"
    out.mkdir()
    marker = out / dirs.MARKER
    _not_regular(marker, how)
    code, err = call(capsys, argv(raw, out, "--overwrite"))
    one_line(code, err, f"{marker}: ")
    with pytest.raises(dirs.DirectoryError, match=f"{marker}: .*not a marker this project"):
        dirs.check_run_dir(out)


def test_a_marker_that_is_a_link_to_a_marker_is_refused(tmp_path):
    """A link would lend a directory another's identity: only a regular file is a marker."""
    real = tmp_path / "real"
    real.mkdir()
    dirs.write_marker(real, "preprocess_data", "data")
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / dirs.MARKER).symlink_to(real / dirs.MARKER)
    with pytest.raises(dirs.DirectoryError, match="a symbolic link, not a regular file"):
        dirs.read_marker(fake)


@pytest.mark.parametrize("name", ["manifest.json", "export.json", "latest", "metrics.jsonl"])
@pytest.mark.parametrize("how", HOWS)
def test_files_that_recognise_a_directory_are_read_bounded(tmp_path, name, how):
    """The files that show an older output of ours (formats/dirs.py LEGACY) are not ours when
    they are not small regular files: not recognised, never read without end or blocked on."""
    _not_regular(tmp_path / name, how)
    assert dirs.recognise(tmp_path) is None


@pytest.mark.parametrize("how", HOWS)
def test_json_records_are_read_bounded(tmp_path, how):
    """read_json_object (a DATA_DIR's manifest.json, best.json, train_config.json)."""
    _not_regular(tmp_path / "manifest.json", how)
    with pytest.raises(DataError, match=f"{tmp_path / 'manifest.json'}: "):
        read_data_manifest(tmp_path)
    with pytest.raises(FileShapeError, match="not a regular file|larger than 1,024 bytes"):
        read_small_file(tmp_path / "manifest.json", 1024)
