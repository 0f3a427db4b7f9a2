"""Every command the docs and README show is checked against the code that would run it.

Each shell block (```bash, sh, shell, console) of README.md and docs/ (the generated
reference aside: it holds --help, not commands) is split into commands, and each command is
checked by what it runs:

- a front door (``tools/X.py``, ``megatron_branchnorm/train.py``, ``python -m MODULE``, a
  console script ``mbn-*``, ``deepspeed ... --module megatron_branchnorm.train``): every
  ``--flag`` is an option of its parser (the parser its ``main`` builds, caught before it runs
  anything), ``--config`` names a shipped config or a file, and every ``key=value`` override
  of train.py names a config key;
- ``make T``: T is a target of the Makefile; ``sbatch``/``bash``/``sh`` of the checkout's
  scripts: the script exists;
- the shell's and the machine's everyday commands (``cd``, ``pip``, ``squeue``...): as they
  are (:data:`OTHER_COMMANDS`); anything else fails the test, naming the page and line.

A block right after the comment ``<!-- test: run -->`` also runs as written, in a temporary
directory that holds the checkout's tools, package, launchers and venv (CPU, seconds): its
exit status must be 0.
"""

from __future__ import annotations

import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.commands import FRONT_DOORS, FrontDoor
from megatron_branchnorm.commands.reference import config_keys, door_parser

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [ROOT / "README.md"]
    + [p for p in (ROOT / "docs").rglob("*.md") if "reference" not in p.relative_to(ROOT).parts]
)
BLOCK = re.compile(r"^(?P<fence>```+)(?:bash|sh|shell|console)\s*\n(?P<body>.*?)^(?P=fence)\s*$",
                   re.S | re.M)  # fmt: skip
RUN_MARK = "<!-- test: run -->"
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)", "$PY"}
OTHER_COMMANDS = {
    "cd", "export", "source", "echo", "cat", "head", "tail", "ls", "mkdir", "cp", "mv", "rm",
    "ln", "grep", "wc", "du", "df", "tar", "find", "sort", "uniq", "diff", "cmp", "sed", "awk",
    "tee", "time", "env", "nproc", "lscpu", "sha256sum", "unzip", "zcat", "gunzip", "xargs",
    "pip", "pip3", "git", "sudo", "apt-get", "tensorboard", "sacrebleu", "nvidia-smi", "kill",
    "squeue", "scancel", "scontrol", "sinfo", "sacct", "srun", "salloc", "watch", "jq", "true",
    "wget", "curl", "spm_encode", "spm_decode", "mkdocs", "ruff", "pytest", "for", "do",
    "done", "if", "then", "fi", "while", "read", "test", "[", "ssh", "printf", "touch",
}  # fmt: skip
"""Commands the docs may show that are not the project's: taken as they are."""


def blocks(page: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, marked to run) of each shell block of ``page``."""
    text = page.read_text(encoding="utf-8")
    found = []
    for m in BLOCK.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip().rsplit("\n", 1)[-1].strip()
        found.append((line, m.group("body"), before == RUN_MARK))
    return found


def commands(body: str) -> list[list[str]]:
    """The simple commands of a shell block: continuations joined, comments and a console's
    ``$ `` prompt dropped, split at ``&&``, ``||``, ``;`` and ``|``; leading ``NAME=value``
    assignments left out."""
    joined = re.sub(r"\\\n", " ", body)
    found = []
    for raw in joined.splitlines():
        raw = raw.strip().removeprefix("$ ")
        if not raw or raw.startswith("#"):
            continue
        raw = re.sub(r"(^|\s)\d*>&\d+", " ", raw)  # 2>&1: no file named
        raw = re.sub(r"(^|\s)\d+(>>?|<)", r" \2", raw)  # 2> FILE: the file is skipped below
        lexer = shlex.shlex(raw, posix=True, punctuation_chars=";&|()<>")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        current: list[str] = []
        redirected = False
        for token in lexer:
            if set(token) <= set("<>&") and ("<" in token or ">" in token):
                redirected = True  # the next word is a file, not a command
                continue
            if set(token) <= set(";&|()"):
                if current:
                    found.append(current)
                current = []
                continue
            if redirected:
                redirected = False
                continue
            current.append(token)
        if current:
            found.append(current)
    for argv in found:
        while argv and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", argv[0]):
            del argv[0]
    return [argv for argv in found if argv]


@functools.cache
def options_of(door: FrontDoor) -> dict[str, set[str]]:
    """The option strings of ``door``'s parser (key ""), and of each of its subcommands."""
    import argparse

    parser = door_parser(door)
    found = {"": set(parser._option_string_actions)}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found[name] = set(sub._option_string_actions)
    return found


@functools.cache
def known_keys() -> set[str]:
    return {k.key for k in config_keys()}


@functools.cache
def make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w.-]*)\s*:(?!=)", text, re.M))


def door_of(argv: list[str]) -> tuple[FrontDoor, list[str]] | None:
    """The front door ``argv`` runs and the arguments it gets; None when it runs none."""
    first = argv[0]
    if first in PYTHONS and len(argv) > 1:
        if argv[1] == "-m" and len(argv) > 2:
            for door in FRONT_DOORS:
                if door.module == argv[2]:
                    return door, argv[3:]
            return None
        script = argv[1]
        for door in FRONT_DOORS:
            if door.tool and script in (f"tools/{door.tool}.py", f"{door.tool}.py"):
                return door, argv[2:]
            if door.name == "train" and script.endswith("megatron_branchnorm/train.py"):
                return door, argv[2:]
        return None
    if first == "deepspeed":  # the launcher's own flags come before the module or script
        for i, token in enumerate(argv):
            if token == "--module" and i + 1 < len(argv):
                return door_of(["python", "-m", argv[i + 1], *argv[i + 2 :]])
            if token.endswith(".py"):
                return door_of(["python", token, *argv[i + 1 :]])
        return None
    for door in FRONT_DOORS:
        if door.console and first == door.console:
            return door, argv[1:]
    return None


def problems_of(argv: list[str]) -> list[str]:
    """What is wrong with one command of the docs (nothing: an empty list)."""
    first = argv[0]
    found = door_of(argv)
    if found is not None:
        door, args = found
        options = options_of(door)
        sub = next((a for a in args if not a.startswith("-")), "")
        allowed = options[""] | options.get(sub, set())
        wrong = [a.split("=", 1)[0] for a in args if a.startswith("--")]
        wrong = [a for a in wrong if a not in allowed]
        problems = [f"{door.name} has no option {a}" for a in wrong]
        if door.name == "train":
            for a in args:
                key = a.split("=", 1)[0]
                if "=" in a and not a.startswith("-") and key not in known_keys():
                    problems.append(f"train.py: no config key {key}")
            if "--config" in args:
                value = args[args.index("--config") + 1]
                shipped = ROOT / "megatron_branchnorm" / "configs" / f"{value}.yaml"
                if "/" not in value and not value.endswith(".yaml") and not shipped.exists():
                    problems.append(f"--config {value}: no shipped config of that name")
        return problems
    if first in PYTHONS:
        if len(argv) > 2 and argv[1] == "-m" and argv[2] in ("pip", "pytest", "venv", "mkdocs"):
            return []
        return [f"{' '.join(argv[:3])}: runs no front door of the project"]
    if first == "make":
        targets = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
        return [f"make: no target {t}" for t in targets if t not in make_targets()]
    if first in ("sbatch", "bash", "sh"):
        scripts = [a for a in argv[1:] if not a.startswith("-") and a != "..."][:1]
        return [f"{first} {s}: no such script" for s in scripts if not (ROOT / s).is_file()]
    if first.startswith(("./", "tools/", "slurm/")):
        return [] if (ROOT / first).is_file() else [f"{first}: no such file"]
    if first in OTHER_COMMANDS:
        return []
    return [f"{first}: not a command the docs test knows (add it to OTHER_COMMANDS if it is fine)"]


CASES = [
    pytest.param(page, line, body, run, id=f"{page.relative_to(ROOT)}:{line}")
    for page in PAGES
    for line, body, run in blocks(page)
]


FENCE = re.compile(r"^(```+)(\S*)", re.M)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_block_says_its_language(page: Path) -> None:
    """An untagged block would escape the checks below: every opening fence names its
    language (bash for commands; text, yaml, json... for the rest)."""
    untagged, open_fence = [], None
    for m in FENCE.finditer(page.read_text(encoding="utf-8")):
        if open_fence is None:
            open_fence = m.group(1)
            if not m.group(2):
                untagged.append(page.read_text(encoding="utf-8").count("\n", 0, m.start()) + 1)
        elif m.group(1) == open_fence and not m.group(2):
            open_fence = None
    assert not untagged, f"{page.relative_to(ROOT)}: untagged blocks at lines {untagged}"


def test_the_docs_have_shell_blocks_to_check() -> None:
    assert len(CASES) > 20, [c.id for c in CASES]


@pytest.mark.parametrize(("page", "line", "body", "run"), CASES)
def test_every_command_shown_names_what_exists(page: Path, line: int, body: str, run: bool):
    problems = [p for argv in commands(body) for p in problems_of(argv)]
    assert not problems, f"{page.relative_to(ROOT)}:{line}: " + "; ".join(problems)


def test_the_checker_finds_what_is_wrong() -> None:
    """The checks on known bad commands: each is caught, and a good one passes."""
    assert problems_of(["python", "tools/translate.py", "--beam", "4", "--beam-width", "2"]) == [
        "translate has no option --beam-width"
    ]
    bad_key = ["deepspeed", "--num_gpus", "2", "--module", "megatron_branchnorm.train",
               "--config", "tiny_cpu", "train.max_stepz=3"]  # fmt: skip
    assert problems_of(bad_key) == ["train.py: no config key train.max_stepz"]
    assert problems_of(["make", "tests"]) == ["make: no target tests"]
    assert problems_of(["sbatch", "slurm/nowhere.sh"]) == [
        "sbatch slurm/nowhere.sh: no such script"
    ]
    assert problems_of([".venv/bin/python", "megatron_branchnorm/train.py", "--config", "nope"])
    assert problems_of(["frobnicate"])
    good = ["mbn-train", "--config", "tiny_cpu", "train.max_steps=3"]
    assert problems_of(good) == []
    assert commands("FOO=1 make test && echo ok | cat > out.txt 2>&1  # done\n") == [
        ["make", "test"],
        ["echo", "ok"],
        ["cat"],
    ]


RUNNABLE = [c for c in CASES if c.values[3]]


@pytest.mark.parametrize(("page", "line", "body", "run"), RUNNABLE)
def test_blocks_marked_to_run_run_as_written(tmp_path, page: Path, line: int, body: str, run):
    """A marked block, run by bash -e in a directory laid out as a checkout (its tools,
    package, launchers, Makefile and venv linked in): exit 0."""
    for name in ("tools", "megatron_branchnorm", "slurm", "Makefile", "setup.py"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / ".venv").symlink_to(Path(sys.prefix))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        ["bash", "-e", "-c", body], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, (
        f"{page.relative_to(ROOT)}:{line} exited {proc.returncode}\n"
        + proc.stdout[-2000:] + proc.stderr[-2000:]
    )  # fmt: skip
