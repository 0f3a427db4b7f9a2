"""Every option of every front door that writes a file or a directory follows one placement rule
(formats/outputs.py): never inside a directory of a known kind (a run, one of its checkpoints, a
DATA_DIR, an export: formats/dirs.py) unless it is the tool's own output, never over a file or
a directory the tool did not write without ``--overwrite``, checked before any work.

``commands.OUTPUT_OPTIONS`` declares those options. This file checks the declaration against
each door's argparse parser (an option that looks like an output and is not declared fails),
then runs every declared option in this process against a run's files, another DATA_DIR's and
export's, and a user's file: exit 2, one line naming the option and the path, and nothing
changed. The model is never loaded: the check comes first.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import inspect
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from megatron_branchnorm.commands import FRONT_DOORS, OUTPUT_OPTIONS
from megatron_branchnorm.formats import dirs
from megatron_branchnorm.inference import translate as translate_lib
from tests.data.conftest import make_opus
from tests.data.test_locale_corpus import _fake_locale
from tests.inference.test_evaluate import make_data_dir

pytestmark = pytest.mark.faults

DOORS = {d.name: d for d in FRONT_DOORS}
OUTPUT_DESTS = frozenset(
    {"output", "out", "json", "markdown", "stats", "hyp_dir", "workdir", "work", "dir"}
    | {"save_dir", "log", "log_dir", "csv", "report", "table", "plot", "png", "svg", "pdf"}
)
"""Option names that say an output."""
OUTPUT_HELP = re.compile(r"\b(write|writes|written|to create)\b", re.IGNORECASE)
"""Help text that says an output."""
NOT_OUTPUTS = {
    ("convert", "--repartition"): "a mode taking a stage count; its output is --output",
}
"""Options that look like an output and are not one."""


# --------------------------------------------------------------------------------------------
# The declaration against the parsers
# --------------------------------------------------------------------------------------------


class _Parsed(BaseException):
    """Raised instead of parsing: carries the door's parser (a BaseException, so that no
    ``run_main`` or ``except Exception`` of a door swallows it)."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__()
        self.parser = parser


def door_parser(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser a door builds for its command line, caught when it starts parsing."""

    def caught(self, args=None, namespace=None):
        raise _Parsed(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", caught)
        m.setattr(sys, "argv", [name, "--help"])
        main = importlib.import_module(DOORS[name].module).main
        try:
            main(["--help"]) if inspect.signature(main).parameters else main()
        except _Parsed as found:
            return found.parser
    pytest.fail(f"{name}: main() returned without parsing a command line")


def options(parser: argparse.ArgumentParser, prefix: str = "") -> dict[str, argparse.Action]:
    """Every option of ``parser`` taking a value, by its longest flag (``SUB --flag`` for a
    sub-command's)."""
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, subparser in action.choices.items():
                found.update(options(subparser, f"{prefix}{sub} "))
        elif action.option_strings and action.nargs != 0:
            found[prefix + max(action.option_strings, key=len)] = action
    return found


def looks_like_output(action: argparse.Action) -> bool:
    return action.dest in OUTPUT_DESTS or bool(OUTPUT_HELP.search(action.help or ""))


def test_every_door_declares_its_outputs():
    assert set(OUTPUT_OPTIONS) == set(DOORS)
    for name, declared in OUTPUT_OPTIONS.items():
        assert set(declared.values()) <= {"file", "dir"}, name


@pytest.mark.parametrize("name", sorted(DOORS))
def test_declared_outputs_match_the_parser(name, monkeypatch):
    """Every option that looks like an output is declared, and every declared one exists: a
    new output option cannot bypass the placement tests below."""
    found = options(door_parser(name, monkeypatch))
    undeclared = [
        flag
        for flag, action in found.items()
        if looks_like_output(action)
        and flag not in OUTPUT_OPTIONS[name]
        and (name, flag) not in NOT_OUTPUTS
    ]
    assert undeclared == [], f"{name}: declare in commands.OUTPUT_OPTIONS"
    assert sorted(set(OUTPUT_OPTIONS[name]) - set(found)) == [], f"{name}: no such option"


# --------------------------------------------------------------------------------------------
# Running every declared option
# --------------------------------------------------------------------------------------------


def fake_run(path: Path) -> Path:
    """A run from before markers: ``latest``, a checkpoint with its manifest, the history."""
    tag = path / "global_step4"
    tag.mkdir(parents=True)
    (tag / "checksums.json").write_text('{"files": {}}\n')
    (tag / "train_config.json").write_text('{"config": {}}\n')
    (path / "latest").write_text("global_step4")
    (path / "metrics.jsonl").write_text('{"step": 1, "loss": 9.5}\n{"step": 2, "loss": 9.1}\n')
    (path / "config.yaml").write_text("train:\n  save_dir: run\n")
    return path


def fake_export(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "export.json").write_text(json.dumps({"format": dirs.EXPORT_FORMAT}) + "\n")
    (path / "config.yaml").write_text("model:\n  layers: 1\n")
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


@pytest.fixture
def tree(tmp_path) -> dict[str, Path]:
    """A run (``run``, its checkpoint ``tag``), a DATA_DIR and an export that tools read
    (``data``, ``export``) and others that they do not (``data2``, ``export2``), a user's
    folder, a source text and a raw corpus."""
    t = {"run": fake_run(tmp_path / "run"), "ckpt": fake_run(tmp_path / "ckpt")}
    t["tag"] = t["run"] / "global_step4"
    t["data"] = make_data_dir(tmp_path / "d1")
    t["data2"] = make_data_dir(tmp_path / "d2")
    t["export"], t["export2"] = fake_export(tmp_path / "e1"), fake_export(tmp_path / "e2")
    t["user"] = tmp_path / "user"
    t["user"].mkdir()
    (t["user"] / "mine.txt").write_text("a user's own notes\n")
    t["src"] = tmp_path / "in.de"
    t["src"].write_text("hallo welt\n")
    make_opus(tmp_path / "raw", {"de": (20, 3, 3)})
    t["raw"] = tmp_path / "raw"
    t["locale"] = tmp_path / "locale"
    _fake_locale(t["locale"], ("de",))
    t["new"] = tmp_path / "new"
    return t


def preprocess_argv(t: dict[str, Path], out: Path) -> list:
    return [
        "--format", "opus100", "--input", t["raw"], "--langs", "de", "--output", out,
        "--vocab-size", "100", "--character-coverage", "1.0", "--workers", "1", "--no-progress",
    ]  # fmt: skip


def translate_argv(t: dict[str, Path]) -> list:
    return ["--model", t["export"], "--src-lang", "de", "--tgt-lang", "en", "--input", t["src"]]


def evaluate_argv(t: dict[str, Path]) -> list:
    return ["--model", t["export"], "--data", t["data"], "--quiet"]


Argv = Callable[[dict[str, Path], Path], list]
RUNS: dict[tuple[str, str], Argv] = {
    ("preprocess", "--output"): lambda t, out: preprocess_argv(t, out),
    ("preprocess", "--stats"): lambda t, out: [*preprocess_argv(t, t["new"]), "--stats", out],
    ("convert", "--output"): lambda t, out: ["--checkpoint", t["ckpt"], "--output", out],
    ("translate", "--output"): lambda t, out: [*translate_argv(t), "--output", out],
    ("evaluate", "--json"): lambda t, out: [*evaluate_argv(t), "--json", out],
    ("evaluate", "--hyp-dir"): lambda t, out: [*evaluate_argv(t), "--hyp-dir", out],
    ("plot", "--output"): lambda t, out: [t["run"], "--output", out],
    ("corpus", "--output"): lambda t, out: [
        "--langs",
        "de",
        "--locale-dir",
        t["locale"],
        "--min-pairs",
        "1",
        "--output",
        out,
    ],  # fmt: skip
    ("demo", "--out"): lambda t, out: ["--out", out],
    ("depth_study", "--out"): lambda t, out: ["--out", out],
    ("fairseq_side_by_side", "--out"): lambda t, out: ["--out", out],
    ("opus_like", "--output"): lambda t, out: [
        "--output",
        out,
        "--pairs",
        "40",
        "--n-pairs",
        "1",
        "--dev-size",
        "2",
        "--test-size",
        "2",
    ],  # fmt: skip
}
"""A command line for each declared output option that works but for the output it names."""
GAPS = {
    ("rehearse", "--json"): "written after the rehearsal with no check",
    ("rehearse", "--markdown"): "written after the rehearsal with no check",
    ("gpu_check", "--json"): "written after the checks with no check",
    ("analyze_model", "--output"): "written with no check",
    ("analyze_model", "--json"): "written with no check",
    ("bench_plan", "--json"): "written with no check",
    ("benchmark", "--json"): "written with no check",
    ("gpu_bench", "--json"): "written with no check",
    ("launches", "--json"): "written with no check",
    ("launches", "--out"): "an internal file of its own child processes",
    ("probe_learning", "--output"): "written with no check",
    ("sweep", "table --markdown"): "checked against its inputs only",
    ("sweep", "table --json"): "checked against its inputs only",
    ("gpu_check", "--workdir"): "writes into a user's non-empty folder",
    ("benchmark", "--workdir"): "writes into a user's non-empty folder",
    ("gpu_bench", "--workdir"): "writes into a user's non-empty folder",
    ("bench_plan", "--work"): "a cache of DATA_DIRs, written with no check",
    ("rehearse", "--workdir"): "not run here: needs a config and runs training",
    ("local_slurm", "--dir"): "not run here: starts a local cluster",
    ("rehearse_slurm", "--work"): "not run here: needs a cluster",
    ("rehearse_node_loss", "--work"): "not run here: needs a cluster",
    ("fault_sweep", "--out"): "not run here: kills training runs",
    ("sweep", "submit --out"): "not run here: submits jobs",
}
"""Declared file options of workflows and experiments not yet routed through the rule (their
modules are outside commands/): each still fails the test below once it has a command line in
:data:`RUNS`."""
OWN_KIND = {("preprocess", "--output"): "data2", ("convert", "--output"): "export2"}
"""The folder of :func:`tree` that is of an option's own kind: ``--overwrite`` replaces it,
which tests/faults/test_misuse_outputs.py tests."""
SUFFIX = {("plot", "--output"): ".png", ("analyze_model", "--output"): ".png"}
"""The name an output must end with to be written at all."""

FILE_CASES = {
    "run_history": ("run", "metrics.jsonl"),
    "run_latest": ("run", "latest"),
    "new_file_in_a_run": ("run", "notes.txt"),
    "checkpoint_manifest": ("tag", "checksums.json"),
    "new_file_in_a_checkpoint": ("tag", "notes.txt"),
    "another_data_dirs_manifest": ("data2", "manifest.json"),
    "another_exports_config": ("export2", "config.yaml"),
    "users_file": ("user", "mine.txt"),
}
"""Where a file output is pointed: (folder of :func:`tree`, name)."""
DIR_CASES = {
    "the_run": ("run", None),
    "a_checkpoint": ("tag", None),
    "new_dir_in_a_checkpoint": ("tag", "out"),
    "another_data_dir": ("data2", None),
    "another_export": ("export2", None),
    "users_folder": ("user", None),
}
"""Where a directory output is pointed."""


def cases():
    """Each declared output option against each place it must not land, without and with
    ``--overwrite`` (a user's file only without: replacing it is what the flag is for); one
    expected failure for each option in :data:`GAPS`."""
    for name, declared in sorted(OUTPUT_OPTIONS.items()):
        for flag, what in declared.items():
            option = f"{name}-{flag.replace(' ', '_')}"
            if (name, flag) in GAPS:
                mark = pytest.mark.xfail(run=False, reason=GAPS[(name, flag)])
                yield pytest.param(name, flag, "user", None, False, marks=mark, id=option)
                continue
            for case, (folder, entry) in (FILE_CASES if what == "file" else DIR_CASES).items():
                for overwrite in (False, True):
                    if overwrite and folder == "user" and what == "file":
                        continue
                    if overwrite and entry is None and OWN_KIND.get((name, flag)) == folder:
                        continue
                    how = "overwrite" if overwrite else "plain"
                    yield pytest.param(
                        name, flag, folder, entry, overwrite, id=f"{option}-{case}-{how}"
                    )


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` with a digest of its bytes (directories as ``dir``)."""
    found = {}
    for p in sorted(root.rglob("*")):
        key = str(p.relative_to(root))
        found[key] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def never_load(*args, **kwargs):
    raise AssertionError("the model was loaded before the output was checked")


@pytest.mark.parametrize(("name", "flag", "folder", "entry", "overwrite"), list(cases()))
def test_an_output_never_lands_on_another_tools_file(
    name, flag, folder, entry, overwrite, tree, tmp_path, capsys, monkeypatch
):
    """``translate --output RUN/metrics.jsonl``, ``evaluate --json RUN/latest`` and the like
    replaced a run's history, a checkpoint's manifest, another DATA_DIR's or export's files, or
    a user's file, exit 0. Now each is refused before any work: exit 2, one line naming the
    option and the path, nothing changed (with --overwrite too, but for a user's file)."""
    build = RUNS.get((name, flag))
    assert build is not None, f"{name} {flag}: add a command line to RUNS (or a GAPS entry)"
    target = tree[folder] if entry is None else tree[folder] / entry
    if (name, flag) in SUFFIX and entry is not None:
        target = target.with_suffix(SUFFIX[(name, flag)])
        if not target.exists():
            target.write_bytes(b"precious\n")
    if overwrite and "--overwrite" not in door_parser(name, monkeypatch)._option_string_actions:
        pytest.skip(f"{name} has no --overwrite")
    monkeypatch.setattr(translate_lib.Translator, "from_export", classmethod(never_load))
    before = snapshot(tmp_path)
    sub = flag.split(" ")[:-1]
    argv = [*sub, *build(tree, target), *(["--overwrite"] if overwrite else [])]
    code = importlib.import_module(DOORS[name].module).main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [x for x in err.strip().splitlines() if "real_accelerator" not in x]
    assert code == 2 and "Traceback" not in err, (code, err[-2000:])
    assert len(lines) == 1 and re.match(r"(\S+: )?error: ", lines[0]), err[-2000:]
    assert f"{flag.split(' ')[-1]} {target}" in lines[0], lines[0]
    after = {k: v for k, v in snapshot(tmp_path).items() if not k.startswith("new")}
    assert after == {k: v for k, v in before.items() if not k.startswith("new")}


# --------------------------------------------------------------------------------------------
# What still works: stdout, devices, a tool's own earlier output, --overwrite
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A tiny export with a SentencePiece model tagged for de, en and zh."""
    import sentencepiece as spm

    from megatron_branchnorm.inference.export import save_export
    from megatron_branchnorm.model import build_model
    from tests.inference.helpers import LANGS, tiny_config, train_spm

    root = tmp_path_factory.mktemp("placement_export")
    spm_path = train_spm(root)
    vocab = spm.SentencePieceProcessor(model_file=str(spm_path)).get_piece_size()
    model = build_model(tiny_config(vocab_size=vocab), 3)
    save_export(model, root / "export", spm_path, {"languages": list(LANGS)})
    return root / "export"


FAST = ["--beam", "1", "--max-len-a", "0", "--max-len-b", "3", "--threads", "1", "--quiet"]


def run(module: str, argv: list, capsys) -> tuple[int, str, str]:
    code = importlib.import_module(module).main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_translate_writes_stdout_devices_and_replaces_a_file_only_with_overwrite(
    export, tmp_path, capsys
):
    """A translation is plain text: nothing tells an earlier one from a user's file, so an
    existing --output needs --overwrite; stdout and /dev/null are written as before."""
    src = tmp_path / "in.de"
    src.write_text("hallo welt\nguten tag\n")
    base = ["--model", export, "--src-lang", "de", "--tgt-lang", "en", "--input", src, *FAST]
    code, out, err = run("megatron_branchnorm.commands.translate", base, capsys)
    assert code == 0 and len(out.splitlines()) == 2, err
    for target in ("/dev/null", "-"):
        code, _, err = run(
            "megatron_branchnorm.commands.translate", [*base, "--output", target], capsys
        )
        assert code == 0, err
    out_file = tmp_path / "out.en"
    code, _, err = run(
        "megatron_branchnorm.commands.translate", [*base, "--output", out_file], capsys
    )
    assert code == 0 and len(out_file.read_text().splitlines()) == 2, err
    out_file.write_text("edited by hand\n")
    code, _, err = run(
        "megatron_branchnorm.commands.translate", [*base, "--output", out_file], capsys
    )
    assert code == 2 and "pass --overwrite" in err and len(err.strip().splitlines()) == 1, err
    assert out_file.read_text() == "edited by hand\n"
    argv = [*base, "--output", out_file, "--overwrite"]
    code, _, err = run("megatron_branchnorm.commands.translate", argv, capsys)
    assert code == 0 and len(out_file.read_text().splitlines()) == 2, err


def test_evaluate_replaces_its_own_report_and_hypotheses_and_nothing_else(export, tmp_path, capsys):
    """--json replaces an earlier report of ours (a user's JSON only with --overwrite);
    --hyp-dir replaces an earlier --hyp-dir of ours whole (its marker), one from before the
    marker only with --overwrite, and never a user's folder."""
    data = make_data_dir(tmp_path)
    report, hyp = tmp_path / "report.json", tmp_path / "hyp"
    base = ["--model", export, "--data", data, "--max-sentences", "2", *FAST]
    evaluate = "megatron_branchnorm.commands.evaluate"
    argv = [*base, "--directions", "de-en,en-zh", "--json", report, "--hyp-dir", hyp]
    code, _, err = run(evaluate, argv, capsys)
    assert code == 0, err
    assert dirs.read_marker(hyp) == {"tool": "evaluate", "kind": "hypotheses"}
    assert sorted(p.name for p in hyp.glob("*.txt")) == ["de-en.txt", "en-zh.txt"]
    # a rerun replaces both, without --overwrite: they are ours
    argv = [*base, "--directions", "de-en", "--json", report, "--hyp-dir", hyp]
    code, _, err = run(evaluate, argv, capsys)
    assert code == 0, err
    assert list(json.loads(report.read_text())["directions"]) == ["de-en"]
    assert sorted(p.name for p in hyp.glob("*.txt")) == ["de-en.txt"]
    # a user's JSON: refused, then replaced with --overwrite
    users = tmp_path / "users.json"
    users.write_text('{"mine": true}\n')
    code, _, err = run(evaluate, [*base, "--json", users], capsys)
    assert code == 2 and "is not a report of evaluate --json" in err and "--overwrite" in err
    assert users.read_text() == '{"mine": true}\n'
    code, _, err = run(evaluate, [*base, "--json", users, "--overwrite"], capsys)
    assert code == 0 and "directions" in json.loads(users.read_text()), err
    # an --hyp-dir from before the marker: only with --overwrite
    older = tmp_path / "older"
    older.mkdir()
    (older / "de-en.txt").write_text("old\n")
    code, _, err = run(evaluate, [*base, "--hyp-dir", older], capsys)
    assert code == 2 and "pass --overwrite" in err, err
    code, _, err = run(evaluate, [*base, "--hyp-dir", older, "--overwrite"], capsys)
    assert code == 0 and dirs.read_marker(older)["kind"] == "hypotheses", err
    # a user's folder: never, even with --overwrite
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.md").write_text("mine\n")
    code, _, err = run(evaluate, [*base, "--hyp-dir", mine, "--overwrite"], capsys)
    assert code == 2 and "never cleared" in err and len(err.strip().splitlines()) == 1, err
    assert [p.name for p in mine.iterdir()] == ["notes.md"]
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]
