"""Every directory knows what it is, and nothing else deletes it.

A run directory, a DATA_DIR and an export each carry an identity (formats/dirs.py); the trainer
starts only in a new or empty directory or in its own run, and every ``--overwrite`` replaces
only a directory of its own kind holding only that kind's entries, naming anything else.
docs/reliability.md ("Directory kinds") lists the kinds and what each ``--overwrite`` deletes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.commands import preprocess as preprocess_cmd
from megatron_branchnorm.commands import watch_bleu
from megatron_branchnorm.data import preprocess, sampling, synthetic_corpus
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import data_dir, dirs, records
from megatron_branchnorm.inference import export
from megatron_branchnorm.training import resume_policy, run_lock
from megatron_branchnorm.training.retention import REMOVING_PREFIX
from megatron_branchnorm.workflows import demo, rehearse
from tests.data.conftest import make_opus
from tests.faults.test_misuse_train import error_line, train

pytestmark = pytest.mark.faults

STEPS = ["train.max_steps=2", "train.save_interval=1"]


def listing(path: Path) -> list[tuple[str, int]]:
    """Every file under ``path`` with its size (to show nothing was touched)."""
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*"))


def call(capsys, module, argv: list) -> tuple[int, str]:
    """(exit code, stderr) of a command's main in this process."""
    code = module.main([str(a) for a in argv])
    return code, capsys.readouterr().err


def one_line(code: int, err: str, *needles: str) -> str:
    lines = [x for x in err.strip().splitlines() if "real_accelerator" not in x]
    assert code == 2 and "Traceback" not in err, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def preprocess_argv(raw: Path, out: Path) -> list:
    return [
        "--format", "opus100", "--input", raw, "--langs", "de", "--output", out,
        "--vocab-size", "100", "--character-coverage", "1.0", "--workers", "1", "--no-progress",
    ]  # fmt: skip


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A 2-update run (checkpoints at 1 and 2) on synthetic data; copy it before changing it."""
    save_dir = tmp_path_factory.mktemp("kinds") / "run"
    (result,) = train(save_dir, STEPS)
    assert result[0] == 0, result[2][-3000:]
    return save_dir


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """(raw corpus, a DATA_DIR preprocessed from it)."""
    root = tmp_path_factory.mktemp("kinds_data")
    make_opus(root / "raw", {"de": (40, 5, 5)})
    code = preprocess_cmd.main([str(a) for a in preprocess_argv(root / "raw", root / "D")])
    assert code == 0
    return root / "raw", root / "D"


# --------------------------------------------------------------------------------------------
# The trainer starts only in a new or empty directory or in its own run
# --------------------------------------------------------------------------------------------


def test_a_data_dir_as_save_dir_is_refused_and_untouched(data, tmp_path):
    """The reported case: ``train.save_dir=D`` with D a DATA_DIR trained into it."""
    raw, D = data
    before = listing(D)
    (result,) = train(D, ["model.vocab_size=null", f"data.dataset={D}", "train.max_steps=2"])
    line = error_line(result)
    assert f"train.save_dir {D}: is a DATA_DIR written by preprocess" in line, line
    assert "a run starts only in a new or empty directory or resumes its own run" in line
    assert listing(D) == before


def test_overwrite_of_a_data_dir_holding_a_run_names_the_runs_files(
    data, finished_run, tmp_path, capsys
):
    """A run that older code trained into a DATA_DIR: ``preprocess --overwrite`` deleted it."""
    raw, D = data
    out = shutil.copytree(D, tmp_path / "D")
    for name in ("global_step2", "metrics.jsonl", "latest", "config.yaml"):
        src = finished_run / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, out / name)
    before = listing(out)
    code, err = call(capsys, preprocess_cmd, [*preprocess_argv(raw, out), "--overwrite"])
    line = one_line(code, err, f"--output {out}: is a DATA_DIR written by preprocess")
    for name in ("global_step2", "metrics.jsonl", "latest", "config.yaml"):
        assert name in line, (name, line)
    assert listing(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["D"]  # no temporary directory left


@pytest.fixture(scope="module")
def exported(finished_run, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("kinds_export") / "export"
    assert convert_cmd.main(["--checkpoint", str(finished_run), "--output", str(out)]) == 0
    return out


def test_an_export_as_save_dir_is_refused(exported, tmp_path):
    out = shutil.copytree(exported, tmp_path / "export")
    before = listing(out)
    (result,) = train(out, STEPS)
    line = error_line(result)
    assert f"train.save_dir {out}: is an export written by convert" in line, line
    assert listing(out) == before
    # An export from before markers: its export.json says what it is.
    (out / dirs.MARKER).unlink()
    (result,) = train(out, STEPS)
    assert "is an export written by convert (by its export.json)" in error_line(result)


def test_a_users_folder_as_save_dir_is_refused_and_their_config_kept(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "config.yaml").write_text("my: own config\n")
    (mine / "notes.txt").write_text("notes")
    (result,) = train(mine, STEPS)
    line = error_line(result)
    assert f"train.save_dir {mine}: holds files this project did not write" in line, line
    assert "config.yaml, notes.txt" in line
    assert (mine / "config.yaml").read_text() == "my: own config\n"
    assert sorted(p.name for p in mine.iterdir()) == ["config.yaml", "notes.txt"]


def test_a_run_resumes_in_its_own_directory(finished_run, tmp_path):
    save_dir = shutil.copytree(finished_run, tmp_path / "run")
    assert dirs.read_marker(save_dir) == {"tool": "train", "kind": "run"}
    (save_dir / "notes.txt").write_text("mine")  # a user's note beside their own run stays
    (result,) = train(save_dir, ["train.max_steps=3", "train.save_interval=1"])
    assert result[0] == 0, result[2][-3000:]
    assert ckpt.read_latest(save_dir) == "global_step3"
    assert (save_dir / "notes.txt").read_text() == "mine"


def test_a_run_from_before_markers_still_resumes_and_gets_its_marker(finished_run, tmp_path):
    save_dir = shutil.copytree(finished_run, tmp_path / "run")
    (save_dir / dirs.MARKER).unlink()
    assert dirs.recognise(save_dir) == ("run", "latest")
    (result,) = train(save_dir, ["train.max_steps=3", "train.save_interval=1"])
    assert result[0] == 0, result[2][-3000:]
    assert ckpt.read_latest(save_dir) == "global_step3"
    assert dirs.read_marker(save_dir) == {"tool": "train", "kind": "run"}


def test_a_new_run_is_marked(tmp_path):
    """Launcher logs (benchmark's rankN.log) and the lock of a BLEU companion started first do
    not make a new run's directory foreign."""
    save_dir = tmp_path / "run"
    save_dir.mkdir()
    (save_dir / "rank0.log").write_text("")
    (save_dir / ".valid_bleu.lock").write_text("")  # the BLEU companion started first
    (result,) = train(save_dir, ["train.max_steps=1"])
    assert result[0] == 0, result[2][-3000:]
    assert dirs.identify(save_dir) == "run"


# --------------------------------------------------------------------------------------------
# --overwrite replaces only its own kind, holding only its own entries
# --------------------------------------------------------------------------------------------


def test_convert_overwrite_onto_an_export_holding_a_users_file_is_refused(
    exported, finished_run, tmp_path, capsys
):
    out = shutil.copytree(exported, tmp_path / "export")
    (out / "thesis.tex").write_text("years of work")
    before = listing(out)
    argv = ["--checkpoint", finished_run, "--output", out, "--overwrite"]
    code, err = call(capsys, convert_cmd, argv)
    one_line(code, err, f"--output {out}: is an export written by convert", "(thesis.tex)")
    assert listing(out) == before
    (out / "thesis.tex").unlink()
    code, err = call(capsys, convert_cmd, argv)
    assert code == 0, err


def test_convert_overwrite_onto_a_run_is_refused(exported, finished_run, tmp_path, capsys):
    """``save_dir=`` an export, trained by older code: ``convert --overwrite`` deleted the run."""
    out = shutil.copytree(exported, tmp_path / "export")
    for name in ("global_step2", "metrics.jsonl", "latest"):
        src = finished_run / name
        (shutil.copytree if src.is_dir() else shutil.copyfile)(src, out / name)
    before = listing(out)
    argv = ["--checkpoint", finished_run, "--output", out, "--overwrite"]
    code, err = call(capsys, convert_cmd, argv)
    one_line(code, err, "global_step2", "latest", "metrics.jsonl")
    assert listing(out) == before
    # A run directory itself is never an export to replace.
    run = shutil.copytree(finished_run, tmp_path / "run")
    before = listing(run)
    argv = ["--checkpoint", finished_run, "--output", run, "--overwrite"]
    code, err = call(capsys, convert_cmd, argv)
    one_line(code, err, f"--output {run}: exists and was not written as export", "a run directory")
    assert listing(run) == before


def test_check_replaceable(tmp_path):
    d = tmp_path / "d"
    assert dirs.check_replaceable(d, "data", "--output") is False
    d.mkdir()
    assert dirs.check_replaceable(d, "data", "--output") is True  # empty
    dirs.write_marker(d, "preprocess_data", "data")
    (d / "bin").mkdir()
    (d / "manifest.json").write_text("{}")
    assert dirs.check_replaceable(d, "data", "--output") is True
    with pytest.raises(dirs.DirectoryError, match=r"is a DATA_DIR written by preprocess: 'data'"):
        dirs.check_replaceable(d, "export", "--output")
    for i in range(10):
        (d / f"user{i}").write_text("x")
    with pytest.raises(dirs.DirectoryError, match=r"\(user0, .*, user7 and 2 more\)"):
        dirs.check_replaceable(d, "data", "--output")


# --------------------------------------------------------------------------------------------
# One owner: every name a tool writes into a kind of directory is that kind's
# --------------------------------------------------------------------------------------------


def test_every_file_a_tool_writes_is_its_kinds(finished_run, data, exported):
    run_names = [
        ckpt.LATEST,
        ckpt.tag_for(7),
        "config.yaml",
        resume_policy.HISTORY,
        records.METRICS_FILE,
        records.BLEU_FILE,
        records.BEST_FILE,
        sampling.SAMPLING_FILE,
        "tensorboard",
        run_lock.LOCK_NAME,
        watch_bleu.LOCK,
        f"{REMOVING_PREFIX}{ckpt.tag_for(3)}",
        f".{ckpt.LATEST}.tmp",
        f".{records.BEST_FILE}.tmp",
        ".write-probe-host-1-abc",
    ]
    assert [n for n in run_names if not dirs.RUN.owns(n)] == []
    assert dirs.foreign_entries(finished_run, "run") == []
    data_names = [data_dir.MANIFEST, "spm.model", "spm.vocab", "bin", "raw", preprocess.SPILL_DIR]
    assert [n for n in data_names if not dirs.DATA.owns(n)] == []
    assert dirs.foreign_entries(data[1], "data") == []
    export_names = [export.WEIGHTS, export.CONFIG, export.SPM, export.META]
    assert [n for n in export_names if not dirs.EXPORT.owns(n)] == []
    assert dirs.foreign_entries(exported, "export") == []
    assert all(dirs.DEMO.owns(n) for n in demo.DEMO_PARTS)
    assert dirs.CORPUS.owns(synthetic_corpus.SUMMARY)
    assert dirs.REHEARSAL.owns(rehearse.RUNS_FILE)
    assert [dirs.identify(p) for p in (finished_run, data[1], exported)] == [
        "run",
        "data",
        "export",
    ]
