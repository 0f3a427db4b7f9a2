"""The members of the misuse classes left open after their first fixes (all in-process):

1. every small file a user may hand us (a run's record files and lock, a checkpoint's
   manifest, a sweep registry, an export's files, a config, a DeepSpeed JSON) is read only
   when it is a regular file, and bounded: a FIFO never blocks a reader, a huge file is
   refused by its size before it is read;
2. the temporaries of an export (``outputs.temp_dir_beside``), of ``publish_dir`` and of an output
   file never replace what sits at their names; a rerun removes only the marked temporaries
   of dead runs of the same output, and says so;
3. ``plot_training.py --output`` never replaces a file that is not a plot of ours (unless
   ``--overwrite``), never goes into a directory of a known kind, and refuses a format it
   does not write in one line before any work;
4. ``sweep.py table --metric valid_bleu`` ranks only scores of the checkpoint now at each
   step (retention's rule), never one of a checkpoint a resume rewrote.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from megatron_branchnorm.commands import plot as plot_cmd
from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.experiments import sweep
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import data_dir, dirs, outputs, records
from megatron_branchnorm.inference.export import ExportError, load_export, save_export
from megatron_branchnorm.model import build_model
from megatron_branchnorm.parallel.planner import precision_from_ds_config
from megatron_branchnorm.runner.plotting import CREATOR, is_our_plot
from megatron_branchnorm.training import run_lock
from tests.inference.helpers import tiny_config

BOUND_S = 20.0
"""How long a reader may stay blocked on a FIFO before the test fails (a bound, never a
measurement: a fixed reader returns at once)."""


def returns_on_fifo(fn: Callable[[], Any], fifo: Path) -> BaseException | None:
    """Run ``fn`` beside the test and return what it raised (None if nothing). A reader still
    blocked on ``fifo`` after :data:`BOUND_S` fails the test, once a writer that opens and
    closes the FIFO has released it."""
    result: list[BaseException | None] = []
    done = threading.Event()

    def run() -> None:
        try:
            fn()
            result.append(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            result.append(exc)
        finally:
            done.set()

    threading.Thread(target=run, daemon=True).start()
    if not done.wait(BOUND_S):
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # the reader sees the end
        done.wait(BOUND_S)
        pytest.fail(f"the reader blocked on the FIFO {fifo}")
    return result[0]


def one_line(exc: BaseException | None, *needles: str) -> str:
    assert exc is not None, "expected a one-line error"
    text = str(exc)
    assert "\n" not in text and all(n in text for n in needles), text
    return text


# ---- 1. bounded reads of user-handed files --------------------------------------------------


def test_record_files_that_are_fifos_are_one_line_not_a_hang(tmp_path):
    for name in (records.METRICS_FILE, records.BLEU_FILE):
        os.mkfifo(tmp_path / name)
    for strict in (True, False):
        exc = returns_on_fifo(
            lambda s=strict: records.read_metrics(tmp_path, strict=s), tmp_path / "metrics.jsonl"
        )
        assert isinstance(exc, records.MetricsFileError)
        one_line(exc, "metrics.jsonl", "a FIFO")
    exc = returns_on_fifo(lambda: records.bleu_scored_keys(tmp_path), tmp_path / records.BLEU_FILE)
    one_line(exc, records.BLEU_FILE, "a FIFO")


def test_record_file_is_streamed_and_bounded(tmp_path, monkeypatch):
    """A long run's metrics.jsonl (tens of MB) reads; a file over the cap is refused by its size
    before any line is read, and a line longer than a row ever is never held whole."""
    rows = [{"step": s, "loss": 1.0} for s in range(1, 51)]
    text = "".join(json.dumps(r) + "\n" for r in rows)
    (tmp_path / records.METRICS_FILE).write_text(text)
    assert records.read_metrics(tmp_path, strict=True) == rows
    monkeypatch.setattr(records, "MAX_RECORD_FILE_BYTES", len(text) - 1)
    with pytest.raises(records.MetricsFileError, match="bytes, more than"):
        records.read_metrics(tmp_path)
    monkeypatch.setattr(records, "MAX_RECORD_FILE_BYTES", 1 << 30)
    monkeypatch.setattr(records, "MAX_RECORD_LINE_BYTES", 64)
    long_row = json.dumps({"step": 51, "loss": 1.0, "pad": "x" * 200})
    (tmp_path / records.METRICS_FILE).write_text(text + long_row + "\n" + '{"step": 52, "lo')
    assert records.read_metrics(tmp_path) == rows  # the long line is a bad line, skipped
    with pytest.raises(records.MetricsFileError, match=r"metrics\.jsonl:51: not a JSON object"):
        records.read_rows(tmp_path, strict=True)


def test_checkpoint_id_of_a_manifest_that_is_a_fifo_or_a_link(tmp_path):
    tag = tmp_path / "global_step2"
    tag.mkdir()
    os.mkfifo(tag / ckpt.MANIFEST)
    exc = returns_on_fifo(lambda: ckpt.checkpoint_id(tag), tag / ckpt.MANIFEST)
    assert isinstance(exc, ckpt.CheckpointError)
    one_line(exc, "checksums.json", "a FIFO")
    (tag / ckpt.MANIFEST).unlink()
    (tmp_path / "elsewhere.json").write_text("{}")
    (tag / ckpt.MANIFEST).symlink_to(tmp_path / "elsewhere.json")
    with pytest.raises(ckpt.CheckpointError, match="symbolic link"):
        ckpt.checkpoint_id(tag)


def test_run_lock_that_is_a_fifo_is_one_line_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / run_lock.LOCK_NAME)
    exc = returns_on_fifo(lambda: run_lock.RunLock(tmp_path).acquire(), tmp_path / "run.lock")
    assert isinstance(exc, run_lock.LockError)
    one_line(exc, "run.lock", "a FIFO")


def test_sweep_registry_that_is_a_fifo_is_one_line_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / sweep.SWEEP_FILE)
    registry = tmp_path / sweep.SWEEP_FILE
    exc = returns_on_fifo(lambda: sweep.read_sweep(registry), registry)
    assert isinstance(exc, sweep.SweepError)
    one_line(exc, "sweep.json", "a FIFO")


def sparse(path: Path, size: int) -> Path:
    """A file of ``size`` bytes that takes no room (what reading it whole would cost)."""
    with open(path, "wb") as fh:
        fh.truncate(size)
    return path


def read_export(tmp_path: Path, name: str, size: int) -> None:
    """Load a fresh export whose ``name`` is replaced by a file of ``size`` bytes."""
    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    sparse(out / name, size)
    load_export(out, verify=False)


HUGE = {
    "export config.yaml": (
        lambda tmp: read_export(tmp, "config.yaml", 5 << 20),
        ExportError,
        r"config\.yaml: larger than 4 MiB",
    ),
    "export.json": (
        lambda tmp: read_export(tmp, "export.json", 2 << 20),
        ExportError,
        r"export\.json: larger than 1 MiB",
    ),
    "--config": (
        lambda tmp: load_config(str(sparse(tmp / "big.yaml", 5 << 20))),
        ConfigError,
        r"big\.yaml: larger than 4 MiB",
    ),
    "train.deepspeed_config": (
        lambda tmp: precision_from_ds_config(str(sparse(tmp / "ds.json", 65 << 20))),
        ConfigError,
        r"ds\.json: larger than 64 MiB",
    ),
}


@pytest.mark.parametrize("case", list(HUGE))
def test_huge_user_file_is_refused_by_its_size_before_it_is_read(tmp_path, case):
    """Each was read whole (then found wrong): now its size refuses it, in one line naming
    it, and nothing is read."""
    read, error, message = HUGE[case]
    with pytest.raises(error, match=message):
        read(tmp_path)


def test_manifest_hash_is_of_the_bytes_parsed(tmp_path, monkeypatch):
    """The manifest was read twice (parsed bounded, then hashed unbounded): a file swapped in
    between (a link to a device, another manifest) was hashed, not the one parsed."""
    manifest = {"format": data_dir.FORMAT, "version": 1, "languages": ["de", "en"]}
    raw = json.dumps(manifest).encode()
    (tmp_path / data_dir.MANIFEST).write_bytes(raw)
    loads = json.loads

    def swap_after_parse(text, *args, **kwargs):
        value = loads(text, *args, **kwargs)
        (tmp_path / data_dir.MANIFEST).write_text(json.dumps({**manifest, "pivot": "de"}))
        return value

    monkeypatch.setattr(json, "loads", swap_after_parse)
    read = data_dir.read_data_manifest(tmp_path)
    monkeypatch.undo()
    assert read.pivot == "en" and read.sha256 == hashlib.sha256(raw).hexdigest()


# ---- 2. temporaries never replace what they did not write -----------------------------------


def dead_owner() -> dict:
    """An owner record of this host whose process no longer runs."""
    return {**run_lock.owner_record(), "pid": 2**22 + 1, "pid_start": "1"}


def test_temp_dir_beside_keeps_what_it_did_not_write(tmp_path, capsys):
    out = tmp_path / "exp"
    users = tmp_path / f".exp.tmp-{os.getpid()}"  # the name the old code cleared first
    users.mkdir()
    (users / "notes.txt").write_text("mine")
    live = tmp_path / ".exp.tmp-live"
    live.mkdir()
    dirs.write_temp_marker(live, "convert_checkpoint", "exp", run_lock.owner_record())
    dead = tmp_path / ".exp.tmp-dead"
    dead.mkdir()
    dirs.write_temp_marker(dead, "convert_checkpoint", "exp", dead_owner())
    other = tmp_path / ".exp2.tmp-dead"
    other.mkdir()
    dirs.write_temp_marker(other, "convert_checkpoint", "exp2", dead_owner())

    tmp = outputs.temp_dir_beside(out, "convert_checkpoint")
    assert (users / "notes.txt").read_text() == "mine"
    assert live.is_dir() and other.is_dir() and not dead.exists()
    assert tmp not in (users, live) and dirs.read_temp_marker(tmp)["output"] == "exp"
    (err_line,) = capsys.readouterr().err.splitlines()
    assert err_line.startswith(f"removed what dead runs of {out} left: .exp.tmp-dead (")


def test_export_over_a_users_directory_at_the_old_names(tmp_path, capsys):
    """save_export cleared ``.exp.tmp-PID`` and ``.exp.old-PID`` before using them; now it
    keeps them, removes a dead export's temporary, and publishes no partial marker."""
    model = build_model(tiny_config(), seed=1)
    out = save_export(model, tmp_path / "exp")
    kept = [tmp_path / f".exp.{kind}-{os.getpid()}" for kind in ("tmp", "old")]
    for path in kept:
        path.mkdir()
        (path / "notes.txt").write_text("mine")
    dead = tmp_path / ".exp.tmp-123-dead"
    dead.mkdir()
    dirs.write_temp_marker(dead, "convert_checkpoint", "exp", dead_owner())
    save_export(model, out, overwrite=True)
    assert all((p / "notes.txt").read_text() == "mine" for p in kept)
    assert not dead.exists() and ".exp.tmp-123-dead" in capsys.readouterr().err
    assert not (out / dirs.TEMP_MARKER).exists() and dirs.identify(out) == "export"
    left = {p.name for p in tmp_path.iterdir()} - {"exp", *(p.name for p in kept)}
    assert left == set()
    load_export(out)


def test_output_file_temporary_never_follows_a_link(tmp_path):
    """write_text_output wrote through ``.NAME.tmp-PID``: a link there made it overwrite the
    link's target."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    (tmp_path / f".out.txt.tmp-{os.getpid()}").symlink_to(victim)
    outputs.write_text_output(tmp_path / "out.txt", "report\n")
    assert (tmp_path / "out.txt").read_text() == "report\n"
    assert victim.read_text() == "precious"
    assert (tmp_path / f".out.txt.tmp-{os.getpid()}").is_symlink()


# ---- 3. plot --output -----------------------------------------------------------------------


@pytest.fixture
def run_dir(tmp_path) -> Path:
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"step": s, "loss": 5.0 - s, "lr": 0.1, "grad_norm": 1.0} for s in (1, 2, 3)]
    (run / records.METRICS_FILE).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def plot(capsys, *argv: str) -> tuple[int, str]:
    code = plot_cmd.main([*map(str, argv)])
    return code, capsys.readouterr().err


def test_plot_refuses_what_is_not_its_own_before_any_work(tmp_path, run_dir, capsys):
    users = tmp_path / "holiday.png"
    users.write_bytes(b"\x89PNG\r\n\x1a\n not ours")
    code, err = plot(capsys, run_dir, "--output", users)
    assert code == 2 and len(err.splitlines()) == 1
    assert "holiday.png: exists and is not a plot of ours" in err and "--overwrite" in err
    assert users.read_bytes() == b"\x89PNG\r\n\x1a\n not ours"
    for name in ("curves.xyz", "curves"):
        code, err = plot(capsys, tmp_path / "missing_run", "--output", tmp_path / name)
        assert code == 2 and len(err.splitlines()) == 1 and "not a format we plot" in err, err
        assert not (tmp_path / name).exists()
    other_run = tmp_path / "other"
    other_run.mkdir()
    dirs.mark_run_dir(other_run)
    code, err = plot(capsys, run_dir, "--output", other_run / "curves.png", "--overwrite")
    assert code == 2 and "lies inside" in err and "a run directory" in err, err
    assert not (other_run / "curves.png").exists()


@pytest.mark.parametrize("fmt", ["svg", "pdf"])
def test_plot_replaces_its_own_and_with_overwrite_anothers(tmp_path, run_dir, capsys, fmt):
    out = tmp_path / f"curves.{fmt}"
    out.write_text("a user's file")
    assert plot(capsys, run_dir, "--output", out, "--overwrite")[0] == 0
    assert is_our_plot(out) and CREATOR.encode() in out.read_bytes()
    out.write_bytes(out.read_bytes() + b"\n")
    assert plot(capsys, run_dir, "--output", out)[0] == 0  # ours: replaced without --overwrite
    assert is_our_plot(out) and not out.read_bytes().endswith(b"\n\n")
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name, "run"]


# ---- 4. sweep --metric valid_bleu -----------------------------------------------------------

DEV = {"split": "dev", "sentences": 8}


def checkpoint(run: Path, step: int, content: str) -> str:
    tag = run / ckpt.tag_for(step)
    tag.mkdir(exist_ok=True)
    (tag / ckpt.MANIFEST).write_text(json.dumps({"step": step, "content": content}))
    return ckpt.checkpoint_id(tag)


def bleu(run: Path, step: int, checkpoint_id: str, value: float, scoring: dict = DEV) -> None:
    row = {"step": step, "checkpoint_id": checkpoint_id, "scoring": scoring, "valid_bleu": value}
    records.append_bleu_row(run, row)


def test_sweep_ranks_only_scores_of_the_checkpoint_now_at_each_step(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / records.METRICS_FILE).write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    old = checkpoint(run, 4, "first branch")
    bleu(run, 2, checkpoint(run, 2, "kept"), 20.0)
    bleu(run, 4, old, 40.0)  # scored, then a resume from step 2 rewrote global_step4
    checkpoint(run, 4, "after the resume")  # not scored yet
    bleu(run, 2, ckpt.checkpoint_id(run / "global_step2"), 55.0, {**DEV, "split": "test"})
    assert sweep.cell_result(run, "valid_bleu") == {"status": "ok", "value": 20.0, "step": 2}
    bleu(run, 4, ckpt.checkpoint_id(run / "global_step4"), 30.0)
    assert sweep.cell_result(run, "valid_bleu") == {"status": "ok", "value": 30.0, "step": 4}
