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
    ("launches", "--out"): "with --child only: where a child it spawned leaves its result, in "
    "the parent's own temporary directory (hidden from --help, refused without --child)",
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


def rehearse_argv(t: dict[str, Path]) -> list:
    return ["--config", "tiny_cpu", "--workdir", t["new"] / "rehearsal"]


def analyze_argv(t: dict[str, Path]) -> list:
    return [t["export"], "--data", t["data"]]


def sweep_dir(t: dict[str, Path]) -> Path:
    """A sweep's directory with an empty registry (under ``new``: its own, not compared)."""
    (t["new"] / "sweep").mkdir(parents=True, exist_ok=True)
    (t["new"] / "sweep" / "sweep.json").write_text('{"cells": {}}\n')
    return t["new"] / "sweep"


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
    ("rehearse", "--workdir"): lambda t, out: ["--config", "tiny_cpu", "--workdir", out],
    ("rehearse", "--json"): lambda t, out: [*rehearse_argv(t), "--json", out],
    ("rehearse", "--markdown"): lambda t, out: [*rehearse_argv(t), "--markdown", out],
    ("gpu_check", "--workdir"): lambda t, out: ["--device", "cpu", "--workdir", out],
    ("gpu_check", "--json"): lambda t, out: ["--device", "cpu", "--json", out],
    ("local_slurm", "--dir"): lambda t, out: ["start", "--dir", out],
    ("rehearse_slurm", "--work"): lambda t, out: ["--work", out],
    ("rehearse_node_loss", "--work"): lambda t, out: ["--work", out],
    ("analyze_model", "--output"): lambda t, out: [*analyze_argv(t), "--output", out],
    ("analyze_model", "--json"): lambda t, out: [
        *analyze_argv(t),
        "--output",
        t["new"] / "a.png",
        "--json",
        out,
    ],  # fmt: skip
    ("apex_layernorm", "--build-dir"): lambda t, out: ["--src", t["new"], "--build-dir", out],
    ("apex_layernorm", "--json"): lambda t, out: ["--src", t["new"], "--json", out],
    ("bench_plan", "--work"): lambda t, out: ["--work", out],
    ("bench_plan", "--json"): lambda t, out: ["--work", t["new"], "--json", out],
    ("benchmark", "--workdir"): lambda t, out: ["--workdir", out],
    ("benchmark", "--json"): lambda t, out: ["--json", out],
    ("fault_sweep", "--out"): lambda t, out: ["hang", "--out", out],
    ("gpu_bench", "--workdir"): lambda t, out: ["--device", "cpu", "--workdir", out],
    ("gpu_bench", "--json"): lambda t, out: ["--device", "cpu", "--json", out],
    ("launches", "--json"): lambda t, out: ["--json", out],
    ("probe_learning", "--output"): lambda t, out: ["--data", t["data"], "--output", out],
    ("sweep", "submit --out"): lambda t, out: [
        "--depths",
        "2",
        "--launcher",
        t["src"],
        "--out",
        out,
    ],
    ("sweep", "table --markdown"): lambda t, out: [sweep_dir(t), "--markdown", out],
    ("sweep", "table --json"): lambda t, out: [sweep_dir(t), "--json", out],
}
"""A command line for each declared output option that works but for the output it names."""
EXPENSIVE = {
    "rehearse": [("workflows.rehearse", "rehearse"), ("workflows.rehearse", "evaluate")],
    "gpu_check": [("workflows.gpu_check", "run_checks")],
    "local_slurm": [("workflows.local_slurm", "start_cluster")],
    "rehearse_slurm": [("workflows.rehearse_slurm", "local_cluster")],
    "rehearse_node_loss": [("workflows.rehearse_node_loss", "local_cluster")],
    "analyze_model": [("inference.export", "load_export")],
    "apex_layernorm": [("experiments.apex_layernorm", "run_check")],
    "bench_plan": [("experiments.bench_plan", "write_data_dir")],
    "benchmark": [("experiments.benchmark", "cpu_info")],
    "fault_sweep": [("experiments.fault_sweep", "hang")],
    "gpu_bench": [("experiments.gpu_bench", "run_bench")],
    "launches": [("experiments.launches", "measure")],
    "probe_learning": [("experiments.probe_learning", "run_variant")],
    "sweep": [("experiments.sweep", "subprocess")],  # sbatch
}
"""What each door starts once its outputs are checked (training, a cluster, a benchmark): made
to fail the test if reached, so that a refusal is seen to come first."""
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


def has_overwrite(name: str) -> bool:
    """Whether the door ``name`` has an ``--overwrite`` flag (its parser's)."""
    with pytest.MonkeyPatch.context() as m:
        return "--overwrite" in door_parser(name, m)._option_string_actions


def cases():
    """Each declared output option against each place it must not land, without and, for a
    door that has ``--overwrite``, with it (a user's file only without: replacing it is what
    the flag is for)."""
    for name, declared in sorted(OUTPUT_OPTIONS.items()):
        overwrites = (False, True) if declared and has_overwrite(name) else (False,)
        for flag, what in declared.items():
            option = f"{name}-{flag.replace(' ', '_')}"
            for case, (folder, entry) in (FILE_CASES if what == "file" else DIR_CASES).items():
                for overwrite in overwrites:
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


class Never:
    """Stands for what a door starts once its outputs are checked (:data:`EXPENSIVE`): any
    call, or any call of one of its attributes, fails the test."""

    def __init__(self, what: str):
        self.what = what

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"{self.what} was reached before the output was refused")

    def __getattr__(self, name: str):
        return self


@pytest.mark.parametrize(("name", "flag", "folder", "entry", "overwrite"), list(cases()))
def test_an_output_never_lands_on_another_tools_file(
    name, flag, folder, entry, overwrite, tree, tmp_path, capsys, monkeypatch
):
    """``translate --output RUN/metrics.jsonl``, ``evaluate --json RUN/latest`` and the like
    replaced a run's history, a checkpoint's manifest, another DATA_DIR's or export's files, or
    a user's file, exit 0. Now each is refused before any work: exit 2, one line naming the
    option and the path, nothing changed (with --overwrite too, but for a user's file)."""
    build = RUNS.get((name, flag))
    assert build is not None, f"{name} {flag}: add a command line to RUNS"
    target = tree[folder] if entry is None else tree[folder] / entry
    if (name, flag) in SUFFIX and entry is not None:
        target = target.with_suffix(SUFFIX[(name, flag)])
        if not target.exists():
            target.write_bytes(b"precious\n")
    monkeypatch.setattr(translate_lib.Translator, "from_export", classmethod(never_load))
    for module, attr in EXPENSIVE.get(name, ()):
        found = importlib.import_module(f"megatron_branchnorm.{module}")
        monkeypatch.setattr(found, attr, Never(f"{module}.{attr}"))
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


def _recognisers() -> dict[str, tuple[Callable[[Path], bool], str]]:
    """Each tool's recogniser of its own earlier report, with a report of that shape."""
    from megatron_branchnorm.experiments import (
        analyze_model,
        bench_plan,
        benchmark,
        gpu_bench,
        launches,
        probe_learning,
        sweep,
    )
    from megatron_branchnorm.workflows import gpu_check, rehearse_report

    rehearse = dict.fromkeys(rehearse_report.REPORT_KEYS, None)
    table = "`python tools/rehearse.py`\n\nCPU: x; all checks passed.\n\n| figure | value |\n"
    return {
        "rehearse --json": (rehearse_report.is_our_report, json.dumps(rehearse)),
        "rehearse --markdown": (rehearse_report.is_our_table, table + "| --- | --- |\n"),
        "gpu_check --json": (
            gpu_check.is_our_report,
            '[{"check": "torch", "value": "2.4", "limit": "", "ok": null}]',
        ),
        "analyze_model --json": (
            analyze_model.is_our_report,
            '{"postln:e": {"export": "e", "sentences": {"de-en": 2}, "encoder": {}}}',
        ),
        "bench_plan --json": (bench_plan.is_our_report, '{"cpu": ["x"], "rows": []}'),
        "benchmark --json": (
            benchmark.is_our_report,
            '{"date": "d", "command": "python tools/benchmark.py --quick"}',
        ),
        "gpu_bench --json": (
            gpu_bench.is_our_report,
            '{"header": "h", "peak_flops": 1.0, "rows": []}',
        ),
        "launches --json": (
            launches.is_our_report,
            json.dumps({"command": launches.COMMAND + " --configs x", "configs": {}}),
        ),
        "probe_learning --output": (
            probe_learning.is_our_records,
            '{"variant": "base", "step": 100, "valid_nll": 5.0}\n{"variant": "base", "step": 200}\n',
        ),
        "sweep table --markdown": (
            sweep.is_our_table,
            "| valid_bleu | 6L-6L | paper |\n| --- | ---: | ---: |\n| postln | 30.10 | 30.2 |\n",
        ),
        "sweep table --json": (
            sweep.is_our_result,
            json.dumps(dict.fromkeys(sweep.RESULT_KEYS, None)),
        ),
    }


@pytest.mark.parametrize(
    "option",
    [
        "rehearse --json",
        "rehearse --markdown",
        "gpu_check --json",
        "analyze_model --json",
        "bench_plan --json",
        "benchmark --json",
        "gpu_bench --json",
        "launches --json",
        "probe_learning --output",
        "sweep table --markdown",
        "sweep table --json",
    ],
)
def test_a_tool_recognises_its_own_report_and_no_other_file(option, tmp_path):
    """A rerun replaces the tool's own earlier report without --overwrite; another tool's
    report, a user's JSON or notes are not taken for one (so they are refused above)."""
    ours, own = _recognisers()[option]
    (tmp_path / "own").write_text(own)
    assert ours(tmp_path / "own")
    others = {
        "user.json": '{"mine": true}\n',
        "notes.md": "| a | b |\n| --- | --- |\n",
        "list.json": "[1, 2]\n",
        "empty": "",
        "evaluate.json": '{"directions": {"de-en": {"bleu": 1.0}}, "averages": {}}\n',
    }
    for name, text in others.items():
        (tmp_path / name).write_text(text)
        assert not ours(tmp_path / name), name
    for option2, (_, text) in _recognisers().items():
        if option2 != option:
            (tmp_path / "other").write_text(text)
            assert not ours(tmp_path / "other"), option2
    assert not ours(tmp_path)  # a directory
    assert not ours(Path("/dev/null"))


def test_sweep_table_replaces_its_own_outputs_and_refuses_a_users_file(tmp_path, capsys):
    """sweep table --markdown/--json: written, replaced on a rerun without any flag, and a
    user's file at either path is refused before anything is written (exit 2, one line)."""
    out = tmp_path / "sweep"
    out.mkdir()
    (out / "sweep.json").write_text('{"cells": {}}\n')
    md, js = tmp_path / "table.md", tmp_path / "table.json"
    sweep = "megatron_branchnorm.experiments.sweep"
    argv = ["table", out, "--markdown", md, "--json", js]
    for _ in range(2):
        code, _, err = run(sweep, argv, capsys)
        assert code == 0, err
        assert md.read_text().startswith("| valid_bleu |") and "cells" in json.loads(js.read_text())
    for path in (md, js):
        path.write_text("mine\n")
        code, _, err = run(sweep, argv, capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1 and str(path) in err, err
        assert path.read_text() == "mine\n"
        path.unlink()


@pytest.mark.parametrize(
    ("tool", "owned", "entries"),
    [
        ("bench_plan", ("pairs_*",), ["pairs_1000/manifest.json"]),
        ("benchmark", None, ["data_20000/manifest.json", "preprocess_20000.log"]),
        ("local_slurm", None, ["slurm.conf", "munge/munge.key", "spool/mbn1/x"]),
    ],
)
def test_a_scratch_dir_of_the_tools_own_is_reused_and_a_users_never(tool, owned, entries, tmp_path):
    """A cache or workdir the tool wrote before is reused; the same with one file of a user's
    added is refused, naming that file, and nothing in it is touched."""
    from megatron_branchnorm.experiments.benchmark import WORK_ENTRIES
    from megatron_branchnorm.formats.outputs import OutputError, check_scratch_dir
    from megatron_branchnorm.workflows.local_slurm import CLUSTER_ENTRIES

    owned = owned or {"benchmark": WORK_ENTRIES, "local_slurm": CLUSTER_ENTRIES}[tool]
    work = tmp_path / "work"
    for entry in entries:
        (work / entry).parent.mkdir(parents=True, exist_ok=True)
        (work / entry).write_text("x")
    check_scratch_dir(work, "--work", tool, owned)
    check_scratch_dir(tmp_path / "absent", "--work", tool, owned)
    (work / "thesis.tex").write_text("years of work")
    before = snapshot(work)
    with pytest.raises(OutputError, match=r"--work .*work: it holds thesis\.tex, which"):
        check_scratch_dir(work, "--work", tool, owned)
    assert snapshot(work) == before
