"""Misuse of convert_checkpoint.py, preprocess_data.py and build_locale_corpus.py (issue:
misuse and bad input): outputs that would destroy inputs, ``--overwrite`` of directories we did
not write, the vocabulary exported with a checkpoint, an alias-bomb config.yaml, numbers and
paths on the command line, a full disk and Ctrl-C.

Every bad input ends in one line ``error: ...`` naming the file, flag or value, and exit 2;
``--overwrite`` removes only a directory our own tool wrote (its marker file, or an older
export / DATA_DIR recognised by export.json / manifest.json). docs/reliability.md, "Misuse",
lists each case with its test.
"""

from __future__ import annotations

import builtins
import errno
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.commands import corpus as corpus_cmd
from megatron_branchnorm.commands import preprocess as preprocess_cmd
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.outputs import MARKER, read_marker, write_marker
from megatron_branchnorm.workflows.rehearse_checks import train_spm
from tests.data.conftest import make_opus
from tests.data.test_locale_corpus import _fake_locale

pytestmark = pytest.mark.faults

ROOT = Path(__file__).resolve().parents[2]
TAGS = ("global_step4", "global_step8", "global_step12")


@pytest.fixture(scope="module")
def tools():
    return {
        "convert_checkpoint": convert_cmd,
        "preprocess_data": preprocess_cmd,
        "build_locale_corpus": corpus_cmd,
    }


def call(tools, capsys, tool: str, argv: list[str]) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of tools/<tool>.py's main (its command) in this process."""
    try:
        code = tools[tool].main([str(a) for a in argv])
    except SystemExit as exc:  # argparse --help only
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def error_line(code: int, err: str, *needles: str) -> str:
    """The one ``error:`` line of a run that exited 2 (no traceback), containing ``needles``."""
    assert "Traceback" not in err, err[-3000:]
    lines = [x for x in err.strip().splitlines() if "real_accelerator" not in x]
    assert code == 2, (code, err[-3000:])
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def listing(path: Path) -> list[tuple[str, int]]:
    """Every file under ``path`` with its size (to show nothing was touched)."""
    return sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*"))


def leftovers(parent: Path) -> list[str]:
    """Hidden temporary/old directories our writers leave on failure (must be none)."""
    return [p.name for p in parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


# --------------------------------------------------------------------------------------------
# Checkpoints with and without a vocabulary
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spms(tmp_path_factory) -> tuple[Path, Path]:
    """Two different tiny SentencePiece models (<2copy>, <2reverse> tags)."""
    root = tmp_path_factory.mktemp("mo_spm")
    return train_spm(root / "a", 40), train_spm(root / "b", 48)


@pytest.fixture(scope="module")
def run(fault_harness, tmp_path_factory) -> Path:
    """A copy of the finished reference run (synthetic data, ``vocab: null``); read-only."""
    return shutil.copytree(fault_harness / "ref", tmp_path_factory.mktemp("mo_run") / "run")


def data_dir(root: Path, spm: Path, name: str = "spm.model", vocab_size: int = 64) -> Path:
    """A DATA_DIR (manifest + spm.model) as far as the converter reads it."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(spm, root / "spm.model")
    manifest = {
        "format": "megatron_branchnorm-data",
        "version": 1,
        "languages": ["copy", "reverse"],
        "vocab_size": vocab_size,
        "spm_model": name,
    }
    (root / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return root


def edit_tag(tag_dir: Path, spm: Path | None, vocab: object = "auto", data: Path | None = None):
    """Give a checkpoint tag a copy of ``spm`` and a ``vocab`` record (``"auto"``: the copy's
    sha256; ``"absent"``: no key, as in older checkpoints), point its data.dataset at
    ``data``, and rewrite its checksums as the trainer would."""
    info_path = tag_dir / "train_config.json"
    info = json.loads(info_path.read_text())
    if spm is not None:
        shutil.copyfile(spm, tag_dir / "spm.model")
    if vocab == "auto":
        info["vocab"] = {"spm_sha256": ckpt.sha256_file(spm), "vocab_size": 64}
    elif vocab == "absent":
        info.pop("vocab", None)
    else:
        info["vocab"] = vocab
    if data is not None:
        info["config"]["data"]["dataset"] = str(data)
    info_path.write_text(json.dumps(info, indent=1, sort_keys=True))
    ckpt.write_manifest(tag_dir, int(info["step"]))


@pytest.fixture
def vocab_run(run, spms, tmp_path) -> Path:
    """The reference run with spm A in every tag (recorded), trained on a DATA_DIR that was
    preprocessed again since (it now holds spm B)."""
    save_dir = shutil.copytree(run, tmp_path / "vrun")
    data = data_dir(tmp_path / "data", spms[1])
    for tag in TAGS:
        edit_tag(save_dir / tag, spms[0], data=data)
    return save_dir


# --------------------------------------------------------------------------------------------
# A. Outputs that would destroy inputs; --overwrite only replaces our own outputs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_convert_output_over_the_run_is_refused(tools, capsys, run, tmp_path, where):
    """``--output RUN --overwrite`` deleted the whole training run (exit 0); ``--output`` a
    parent of RUN deleted sibling folders too."""
    root = tmp_path / "runs"
    save_dir = shutil.copytree(run, root / "run")
    sibling = root / "other_run"
    sibling.mkdir()
    (sibling / "notes.txt").write_text("keep me")
    output = {"same": save_dir, "parent": root, "inside": save_dir / "export"}[where]
    before = listing(root)
    code, _, err = call(
        tools,
        capsys,
        "convert_checkpoint",
        ["--checkpoint", save_dir, "--output", output, "--overwrite"],
    )
    what = {"same": "is the same path as", "parent": "contains", "inside": "lies inside"}[where]
    error_line(code, err, f"--output {output}", what, "--checkpoint")
    assert listing(root) == before


@pytest.mark.parametrize("fmt", ["native", "hf"])
def test_convert_overwrite_refuses_a_directory_we_did_not_write(tools, capsys, run, tmp_path, fmt):
    user = tmp_path / "mine"
    user.mkdir()
    (user / "thesis.tex").write_text("years of work")
    argv = ["--checkpoint", run, "--output", user, "--overwrite", "--format", fmt]
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    error_line(code, err, f"--output {user}", MARKER)
    assert (user / "thesis.tex").read_text() == "years of work"
    assert leftovers(tmp_path) == []


def test_convert_overwrite_replaces_our_exports_only(tools, capsys, run, tmp_path):
    out = tmp_path / "export"
    argv = ["--checkpoint", run, "--output", out]
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    assert code == 0, err
    assert read_marker(out) == {"tool": "convert_checkpoint", "kind": "export"}
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    error_line(code, err, "exists and is not empty", "--overwrite")
    code, _, err = call(tools, capsys, "convert_checkpoint", [*argv, "--overwrite"])
    assert code == 0, err
    # An export written before markers existed (export.json says what it is) is ours too, but
    # a file an export never holds is refused by name, not deleted.
    (out / MARKER).unlink()
    (out / "stale.txt").write_text("x")
    code, _, err = call(tools, capsys, "convert_checkpoint", [*argv, "--overwrite"])
    error_line(code, err, f"--output {out}: is an export written by convert", "(stale.txt)")
    assert (out / "stale.txt").read_text() == "x"
    (out / "stale.txt").unlink()
    code, _, err = call(tools, capsys, "convert_checkpoint", [*argv, "--overwrite"])
    assert code == 0, err
    assert (out / MARKER).is_file()
    # A Hugging Face export is not replaced by a native one (another kind), nor the reverse.
    write_marker(out, "convert_checkpoint", "hf_export")
    code, _, err = call(tools, capsys, "convert_checkpoint", [*argv, "--overwrite"])
    error_line(code, err, "'hf_export'")
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("where", ["same", "parent", "inside"])
def test_preprocess_output_over_the_input_is_refused(tools, capsys, tmp_path, where):
    """``--input X --output X --overwrite`` deleted the raw corpus."""
    raw = tmp_path / "corpora" / "raw"
    make_opus(raw, {"de": (40, 5, 5)})
    output = {"same": raw, "parent": raw.parent, "inside": raw / "data"}[where]
    before = listing(tmp_path)
    argv = base_argv("preprocess_data", output, None, raw, None)
    code, _, err = call(tools, capsys, "preprocess_data", [*argv, "--overwrite"])
    what = {"same": "is the same path as", "parent": "contains", "inside": "lies inside"}[where]
    error_line(code, err, f"--output {output}", what, "--input")
    assert listing(tmp_path) == before


def test_preprocess_overwrite_replaces_a_data_dir_only(tools, capsys, tmp_path):
    make_opus(tmp_path / "raw", {"de": (40, 5, 5)})
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep").write_text("x")
    argv = ["--format", "opus100", "--input", tmp_path / "raw", "--langs", "de"]
    argv += ["--output", out, "--vocab-size", "100", "--character-coverage", "1.0"]
    argv += ["--workers", "1", "--no-progress"]
    code, _, err = call(tools, capsys, "preprocess_data", [*argv, "--overwrite"])
    error_line(code, err, f"--output {out}", MARKER)
    assert (out / "keep").read_text() == "x"
    shutil.rmtree(out)
    code, _, err = call(tools, capsys, "preprocess_data", argv)
    assert code == 0, err
    assert read_marker(out) == {"tool": "preprocess_data", "kind": "data"}
    code, _, err = call(tools, capsys, "preprocess_data", argv)
    error_line(code, err, "exists and is not empty", "--overwrite")
    # An older DATA_DIR (our manifest, no marker) may be replaced; so may a marked one; but
    # a file a DATA_DIR never holds is refused by name, not deleted.
    (out / MARKER).unlink()
    (out / "stale").write_text("x")
    code, _, err = call(tools, capsys, "preprocess_data", [*argv, "--overwrite"])
    error_line(code, err, f"--output {out}: is a DATA_DIR written by preprocess", "(stale)")
    (out / "stale").unlink()
    code, _, err = call(tools, capsys, "preprocess_data", [*argv, "--overwrite"])
    assert code == 0, err
    assert (out / "manifest.json").is_file() and read_marker(out)["kind"] == "data"
    assert leftovers(tmp_path) == []


def test_locale_corpus_output_and_overwrite(tools, capsys, tmp_path):
    locale = tmp_path / "locale"
    _fake_locale(locale, ("de",))
    base = ["--langs", "de", "--locale-dir", locale, "--min-pairs", "10", "--eval-fraction", "0.1"]
    before = listing(locale)
    for output, what in ((locale, "is the same path as"), (locale / "de", "lies inside")):
        code, _, err = call(
            tools, capsys, "build_locale_corpus", [*base, "--output", output, "--overwrite"]
        )
        error_line(code, err, f"--output {output}", what, "--locale-dir")
    assert listing(locale) == before
    out = tmp_path / "corpus"
    out.mkdir()
    (out / "keep").write_text("x")
    code, _, err = call(
        tools, capsys, "build_locale_corpus", [*base, "--output", out, "--overwrite"]
    )
    error_line(code, err, f"--output {out}", MARKER)
    assert (out / "keep").read_text() == "x"
    shutil.rmtree(out)
    code, _, err = call(tools, capsys, "build_locale_corpus", [*base, "--output", out])
    assert code == 0, err
    assert read_marker(out) == {"tool": "build_locale_corpus", "kind": "corpus"}
    code, _, err = call(
        tools, capsys, "build_locale_corpus", [*base, "--output", out, "--overwrite"]
    )
    assert code == 0, err
    assert leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# B. The vocabulary exported with the weights
# --------------------------------------------------------------------------------------------


def test_export_takes_the_checkpoints_own_vocabulary(tools, capsys, vocab_run, spms, tmp_path):
    """Re-preprocessing DATA_DIR after training exported the new spm.model beside the old
    weights; now the tag's own copy is exported (checked against its recorded sha256)."""
    out = tmp_path / "export"
    code, _, err = call(
        tools, capsys, "convert_checkpoint", ["--checkpoint", vocab_run, "--output", out]
    )
    assert code == 0, err
    assert "warning" not in err
    assert (out / "spm.model").read_bytes() == spms[0].read_bytes()
    meta = json.loads((out / "export.json").read_text())
    assert meta["vocab"] == {"source": "checkpoint", "spm_sha256": ckpt.sha256_file(spms[0])}
    assert meta["languages"] == ["copy", "reverse"]


def test_tag_vocabulary_must_match_its_record(tools, capsys, vocab_run, spms, tmp_path):
    tag = vocab_run / "global_step12"
    shutil.copyfile(spms[1], tag / "spm.model")  # another model, checksums rewritten too
    ckpt.write_manifest(tag, 12)
    out = tmp_path / "export"
    code, _, err = call(
        tools, capsys, "convert_checkpoint", ["--checkpoint", vocab_run, "--output", out]
    )
    error_line(code, err, f"{tag / 'spm.model'}:", "vocab.spm_sha256", "train_config.json")
    assert not out.exists() and leftovers(tmp_path) == []


def test_average_last_needs_one_vocabulary(tools, capsys, vocab_run, spms, tmp_path):
    edit_tag(vocab_run / "global_step12", spms[1])
    out = tmp_path / "export"
    argv = ["--checkpoint", vocab_run, "--output", out, "--average-last", "2"]
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    error_line(
        code,
        err,
        str(vocab_run / "global_step8"),
        str(vocab_run / "global_step12"),
        "different vocabularies",
    )
    assert not out.exists()
    edit_tag(vocab_run / "global_step12", spms[0])
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    assert code == 0, err
    assert (out / "spm.model").read_bytes() == spms[0].read_bytes()


def test_older_checkpoint_falls_back_to_data_dir_with_a_warning(tools, capsys, run, spms, tmp_path):
    save_dir = shutil.copytree(run, tmp_path / "old")
    data = data_dir(tmp_path / "data", spms[1])
    edit_tag(save_dir / "global_step12", None, vocab="absent", data=data)
    out = tmp_path / "export"
    code, _, err = call(
        tools, capsys, "convert_checkpoint", ["--checkpoint", save_dir, "--output", out]
    )
    assert code == 0, err
    lines = [x for x in err.strip().splitlines() if "real_accelerator" not in x]
    assert len(lines) == 1 and lines[0].startswith("warning: "), err
    assert "could not be checked" in lines[0] and str(data / "spm.model") in lines[0]
    assert (out / "spm.model").read_bytes() == spms[1].read_bytes()
    assert json.loads((out / "export.json").read_text())["vocab"]["source"] == "data-unchecked"


@pytest.mark.parametrize("name", ["../../secret.model", "ABSOLUTE", "sub/spm.model"])
def test_manifest_cannot_point_outside_the_data_dir(tools, capsys, run, spms, tmp_path, name):
    """A manifest's spm_model ("../../etc/x", an absolute path) was copied into the export."""
    secret = tmp_path / "secret.model"
    shutil.copyfile(spms[1], secret)
    (tmp_path / "d" / "data" / "sub").mkdir(parents=True)
    shutil.copyfile(spms[1], tmp_path / "d" / "data" / "sub" / "spm.model")
    name = str(secret) if name == "ABSOLUTE" else name
    save_dir = shutil.copytree(run, tmp_path / "old")
    data = data_dir(tmp_path / "d" / "data", spms[0], name=name)
    edit_tag(save_dir / "global_step12", None, vocab="absent", data=data)
    out = tmp_path / "export"
    code, _, err = call(
        tools, capsys, "convert_checkpoint", ["--checkpoint", save_dir, "--output", out]
    )
    error_line(code, err, str(data / "manifest.json"), "spm_model")
    assert not out.exists()


def test_repartition_keeps_the_vocabulary(tools, capsys, vocab_run, spms, tmp_path):
    one = tmp_path / "one_stage"
    argv = ["--checkpoint", vocab_run, "--repartition", "1", "--output", one]
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    assert code == 0, err
    tag = one / "global_step12"
    assert "spm.model" in json.loads((tag / ckpt.MANIFEST).read_text())["files"]
    out = tmp_path / "export"
    code, _, err = call(tools, capsys, "convert_checkpoint", ["--checkpoint", one, "--output", out])
    assert code == 0 and "warning" not in err, err
    assert (out / "spm.model").read_bytes() == spms[0].read_bytes()
    # A re-laid checkpoint never replaces a directory, and never goes over its source.
    code, _, err = call(tools, capsys, "convert_checkpoint", [*argv, "--overwrite"])
    error_line(code, err, "--overwrite does not apply to --repartition")
    argv = ["--checkpoint", vocab_run, "--repartition", "1", "--output", vocab_run / "x"]
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    error_line(code, err, "lies inside --checkpoint")
    argv = ["--checkpoint", vocab_run, "--repartition", "40", "--output", tmp_path / "r40"]
    code, _, err = call(tools, capsys, "convert_checkpoint", argv)
    error_line(code, err, "--repartition 40")
    assert not (tmp_path / "r40").exists() and leftovers(tmp_path) == []


# --------------------------------------------------------------------------------------------
# C. An alias-bomb config.yaml in an export
# --------------------------------------------------------------------------------------------

_LEVELS = "abcdefghi"
BOMB = (
    "model:\n  hidden_size: [&a [x, x, x, x, x, x, x, x, x], "
    + ", ".join(
        f"&{k} [{', '.join([f'*{p}'] * 9)}]" for p, k in zip(_LEVELS[:-1], _LEVELS[1:], strict=True)
    )
    + "]\n"
)
"""383 bytes of YAML whose value has 9**9 leaves once its aliases are expanded."""


def test_alias_bomb_config_yaml_is_refused_fast(tmp_path):
    """418 bytes of nested YAML anchors took 10 s, 2.5 GB and a 580 MB error message."""
    from megatron_branchnorm.inference.export import ExportError, load_export, save_export
    from megatron_branchnorm.model import build_model
    from tests.inference.helpers import tiny_config

    out = save_export(build_model(tiny_config(), seed=1), tmp_path / "exp")
    (out / "config.yaml").write_text(BOMB)
    assert len(BOMB) < 420
    t0 = time.perf_counter()
    with pytest.raises(ExportError) as info:
        load_export(out)
    assert time.perf_counter() - t0 < 2.0
    assert "config.yaml" in str(info.value) and len(str(info.value)) < 600


# --------------------------------------------------------------------------------------------
# D. One line and exit 2: numbers, paths, a full disk, Ctrl-C
# --------------------------------------------------------------------------------------------

BAD_NUMBERS = [
    ("convert_checkpoint", "--average-last", "0"),
    ("convert_checkpoint", "--average-last", "nan"),
    ("convert_checkpoint", "--repartition", "0"),
    ("convert_checkpoint", "--repartition", "-2"),
    ("preprocess_data", "--vocab-size", "0"),
    ("preprocess_data", "--vocab-size", "-5"),
    ("preprocess_data", "--character-coverage", "nan"),
    ("preprocess_data", "--character-coverage", "1.5"),
    ("preprocess_data", "--spm-temperature", "0"),
    ("preprocess_data", "--spm-temperature", "inf"),
    ("preprocess_data", "--max-len", "0"),
    ("preprocess_data", "--workers", "0"),
    ("preprocess_data", "--seed", "-1"),
    ("preprocess_data", "--spm-sample-size", "0"),
    ("preprocess_data", "--dev-size", "-1"),
    ("build_locale_corpus", "--min-pairs", "-1"),
    ("build_locale_corpus", "--eval-fraction", "nan"),
    ("build_locale_corpus", "--eval-fraction", "0.9"),
    ("build_locale_corpus", "--max-chars", "0"),
]


@pytest.fixture(scope="module")
def raw_corpus(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mo_raw")
    make_opus(root / "raw", {"de": (40, 5, 5)})
    return root / "raw"


@pytest.fixture(scope="module")
def fake_locale(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mo_locale") / "locale"
    _fake_locale(root, ("de",))
    return root


def base_argv(tool: str, out: Path, run: Path, raw: Path, locale: Path) -> list:
    """A command line that works, for ``tool``, writing ``out``."""
    if tool == "convert_checkpoint":
        return ["--checkpoint", run, "--output", out]
    if tool == "preprocess_data":
        return [
            "--format",
            "opus100",
            "--input",
            raw,
            "--langs",
            "de",
            "--output",
            out,
            "--vocab-size",
            "100",
            "--character-coverage",
            "1.0",
            "--workers",
            "1",
            "--no-progress",
        ]
    return ["--langs", "de", "--locale-dir", locale, "--min-pairs", "10", "--output", out]


@pytest.mark.parametrize(("tool", "flag", "value"), BAD_NUMBERS)
def test_numbers_are_checked(
    tools, capsys, run, raw_corpus, fake_locale, tmp_path, tool, flag, value
):
    out = tmp_path / "out"
    argv = base_argv(tool, out, run, raw_corpus, fake_locale)
    if flag in argv:
        i = argv.index(flag)
        argv = argv[:i] + argv[i + 2 :]
    code, _, err = call(tools, capsys, tool, [*argv, flag, value])
    error_line(code, err, flag, repr(value))
    assert not out.exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize("tool", ["convert_checkpoint", "preprocess_data", "build_locale_corpus"])
def test_output_under_a_regular_file(tools, capsys, run, raw_corpus, fake_locale, tmp_path, tool):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a directory")
    out = blocker / "out"
    code, _, err = call(tools, capsys, tool, base_argv(tool, out, run, raw_corpus, fake_locale))
    error_line(code, err, f"--output {out}", f"{blocker} is not a directory")
    assert blocker.read_text() == "not a directory"


@pytest.mark.parametrize(
    ("tool", "flag"),
    [
        ("convert_checkpoint", "--checkpoint"),
        ("preprocess_data", "--input"),
        ("build_locale_corpus", "--locale-dir"),
    ],
)
def test_missing_input(tools, capsys, run, raw_corpus, fake_locale, tmp_path, tool, flag):
    out = tmp_path / "out"
    argv = base_argv(tool, out, run, raw_corpus, fake_locale)
    argv[argv.index(flag) + 1] = tmp_path / "nowhere"
    code, _, err = call(tools, capsys, tool, argv)
    error_line(code, err, f"{flag} {tmp_path / 'nowhere'}")
    assert not out.exists()


def test_unreadable_input_file(tools, capsys, raw_corpus, tmp_path, monkeypatch):
    """A file that cannot be opened (root reads any file here, so opening it is refused)."""
    victim = next(raw_corpus.rglob("opus.de-en-train.de"))
    real = builtins.open

    def guarded_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and Path(file) == victim:
            raise PermissionError(errno.EACCES, "Permission denied", str(file))
        return real(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", guarded_open)
    out = tmp_path / "out"
    code, _, err = call(
        tools, capsys, "preprocess_data", base_argv("preprocess_data", out, None, raw_corpus, None)
    )
    error_line(code, err, str(victim), "Permission denied")
    assert not out.exists()


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


@pytest.mark.parametrize("tool", ["convert_checkpoint", "preprocess_data", "build_locale_corpus"])
def test_full_disk(tools, capsys, run, raw_corpus, fake_locale, tmp_path, monkeypatch, tool):
    """ENOSPC while writing: one line naming the output, nothing left behind."""
    if tool == "convert_checkpoint":
        from megatron_branchnorm.inference import export

        monkeypatch.setattr(export, "save_file", _enospc)
    elif tool == "preprocess_data":
        from megatron_branchnorm.data import clean_pass

        monkeypatch.setattr(clean_pass, "_write_lines", _enospc)
    else:
        from megatron_branchnorm.data import locale_corpus

        monkeypatch.setattr(locale_corpus, "open", _enospc, raising=False)
    out = tmp_path / "out"
    code, _, err = call(tools, capsys, tool, base_argv(tool, out, run, raw_corpus, fake_locale))
    error_line(code, err, str(out), "no space left on device")
    assert not out.exists() and leftovers(tmp_path) == []


# Run by test_ctrl_c_during_preprocess: the real front door, with SentencePiece training
# replaced by a stand-in that says it started (a file) and then works until it is stopped, so
# the interrupt lands inside the run at a known point (an event, not a delay).
_BLOCKED_SPM = """
import sys, threading
from pathlib import Path
from megatron_branchnorm.data import spm as spm_lib
from megatron_branchnorm.commands.preprocess import main

def training(*args, marker=Path(sys.argv[1]), **kwargs):
    marker.touch()
    threading.Event().wait()

spm_lib.train_spm = training
sys.argv = ["preprocess_data.py", *sys.argv[2:]]
raise SystemExit(main())
"""


def test_ctrl_c_during_preprocess(tmp_path):
    """SIGINT mid-run: exit 130, one line, no traceback, no output and no temporary dir."""
    make_opus(tmp_path / "raw", {"de": (2000, 50, 50), "fr": (2000, 50, 50)})
    out, started = tmp_path / "out", tmp_path / "spm-started"
    argv = ["--format", "opus100", "--input", tmp_path / "raw", "--langs", "de,fr"]
    argv += ["--output", out, "--vocab-size", "150", "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(
        [sys.executable, "-c", _BLOCKED_SPM, str(started), *map(str, argv)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell job has
    )
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and not started.exists():
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    assert started.exists(), "the stand-in SentencePiece training never started"
    assert leftovers(tmp_path), "SentencePiece training started outside a temporary directory"
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C in a terminal: the parent and its workers
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines() == ["interrupted (Ctrl-C): nothing half-written was kept"]
    assert not out.exists() and leftovers(tmp_path) == []


# The same class in the demo and the rehearsal tool, which replace their own outputs on reruns.


def test_demo_refuses_an_out_directory_it_did_not_write(tmp_path):
    from megatron_branchnorm.workflows.demo import DemoError, DemoOptions, run_demo

    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "thesis.tex").write_text("years of work")
    with pytest.raises(DemoError, match="was not written by run_demo"):
        run_demo(DemoOptions(out=home))
    assert (home / "data" / "thesis.tex").read_text() == "years of work"
    corpus = tmp_path / "demo" / "data" / "raw"  # an earlier demo's DATA_DIR as --corpus
    corpus.mkdir(parents=True)
    write_marker(tmp_path / "demo", "run_demo", "demo")
    with pytest.raises(DemoError, match="--corpus .*: lies inside --out .*data"):
        run_demo(DemoOptions(out=tmp_path / "demo", corpus=corpus))


def test_rehearse_overwrite_removes_only_a_rehearsal_workdir(tmp_path):
    from megatron_branchnorm.workflows.rehearse import RehearsalError, rehearse

    mine = tmp_path / "runs"
    (mine / "week3").mkdir(parents=True)
    with pytest.raises(RehearsalError, match="was not written as rehearsal"):
        rehearse(None, mine, overwrite=True)
    assert (mine / "week3").is_dir()


@pytest.mark.parametrize(
    ("tool", "argv"),
    [
        ("depth_study", ["--depths", "2", "--schemes", "postln", "--steps", "1"]),
        ("fault_sweep", ["hang"]),
    ],
)
def test_research_tools_never_clear_a_users_directory(tmp_path, tool, argv):
    """The research tools replace their own parts of --out on reruns (corpus, data, cells,
    reference runs...): a directory they did not write is refused before anything runs."""
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / "data" / "notes.txt").write_text("mine")
    module = importlib.import_module(f"megatron_branchnorm.experiments.{tool}")
    code = module.main([*argv, "--out", str(home)])
    assert code == 2
    assert (home / "data" / "notes.txt").read_text() == "mine"
    assert not (home / ".megatron_branchnorm-output.json").exists()
