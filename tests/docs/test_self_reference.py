"""The project speaks of itself only: the docs, the README, comments, docstrings, messages and
test names never refer to a tracker (``issue 41``, ``#41``, ``issue-28``, "this issue") or to
the work sessions and rounds that built the project.

"session" keeps its real meanings, allowed by phrase: a pytest session (``scope="session"``, a
session fixture), a POSIX process session, a SLURM, SSH or login session. "#N" of another
project's tracker is allowed where the text names that project (``DeepSpeed PR #5481``).
Python files are read by token: comments, strings (docstrings, messages) and the names of
test functions; Markdown, shell scripts and the Makefile as text; file names too."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ["docs", "README.md", "megatron_branchnorm", "tools", "tests", "slurm", "Makefile"]
GENERATED = ROOT / "docs" / "reference"  # generated from the code: scanned through the code
SUFFIXES = {".md", ".py", ".sh", ".yaml", ".json", ".txt"}

TRACKER = [
    re.compile(r"\bissues?[ _-]?#?\d+", re.I),  # issue 41, Issue #9, issue31, issue-28
    re.compile(r"\b(this|that|the) issue's\b|\b(this|that) issue\b", re.I),
    re.compile(r"(?<![\w&/#])#\d{1,5}\b(?![0-9a-fA-F])"),  # #41 (not a colour, not a heading)
    re.compile(r"\bround[ _-]?\d+\b|\brounds? of (work|review)\b", re.I),
    re.compile(r"\bsessions?\b", re.I),
]
ALLOWED = re.compile(
    "|".join(
        [
            r"scope=.session.",
            r"^[\"']session[\"']$",  # the scope argument of a pytest fixture
            r"\bsession[- ](fixtures?|scoped?)\b",
            r"\b(once )?per (test )?session\b",
            r"\bevery test in the session\b",
            r"\bthe session's copy-task model\b",
            r"\b(POSIX|process|SLURM|SSH|login|terminal) sessions?\b",
            r"\banother session's process\b",
            r"\b(its own|its parent's|a new|another) session\b",
            r"\bis in another session\b",
            r"\bpgrp, session\b",
            r"\bDeepSpeed PR #\d+",
            r"\bpull requests? [\d, ]+",
            r"\b(per|each|every|interleaved|alternating) rounds?\b",
        ]
    ),
    re.I,
)


def python_text(source: str) -> list[tuple[int, str]]:
    """(line, text) of the comments, strings and test-function names of Python ``source``."""
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    for i, tok in enumerate(tokens):
        if tok.type in (tokenize.COMMENT, tokenize.STRING) or (
            tok.type == tokenize.FSTRING_MIDDLE if hasattr(tokenize, "FSTRING_MIDDLE") else False
        ):
            for k, line in enumerate(tok.string.splitlines()):
                found.append((tok.start[0] + k, line))
        elif tok.type == tokenize.NAME and i and tokens[i - 1].string in ("def", "class"):
            if tok.string.lower().startswith("test"):
                found.append((tok.start[0], tok.string.replace("_", " ")))
    return found


def hits_in(path: Path, text: str) -> list[str]:
    """Each self-reference of ``path``'s ``text`` as 'path:line: words'."""
    if path.suffix == ".py":
        try:
            lines = python_text(text)
        except (tokenize.TokenError, SyntaxError):
            lines = list(enumerate(text.splitlines(), 1))
    else:
        lines = list(enumerate(text.splitlines(), 1))
    found = []
    for number, line in [(0, path.name.replace("_", " "))] + lines:
        if path.suffix == ".md" and re.match(r"\s*#+ ", line):
            line = re.sub(r"^\s*#+ ", "", line)  # a heading's own marks
        rest = ALLOWED.sub(" ", line)
        for pattern in TRACKER:
            if m := pattern.search(rest):
                found.append(f"{path}:{number}: {m.group(0)!r} in {line.strip()[:100]!r}")
                break
    return found


def scanned_files() -> list[Path]:
    me = Path(__file__).resolve()
    files = []
    for name in SCANNED:
        top = ROOT / name
        candidates = [top] if top.is_file() else [p for p in top.rglob("*") if p.is_file()]
        files += [
            p
            for p in candidates
            if (p.suffix in SUFFIXES or p.name == "Makefile")
            and p != me
            and GENERATED not in p.parents
            and "__pycache__" not in p.parts
        ]
    return sorted(files)


def test_the_patterns_tell_tracker_words_from_real_meanings(tmp_path):
    page = tmp_path / "page.md"
    flagged = [
        "Fixed in issue 41.",
        "See #9 for the targets.",
        "the issue-28 tree",
        "against the issue's goal",
        "measured in session 6",
        "the next session with a GPU runs it",
        "per round 1.05x; round 2 was slower",
    ]
    fine = [
        "@pytest.fixture(scope='session')",
        "one cluster serves every test in the session (a session fixture)",
        "a launcher adopted by a process of another POSIX session",
        "keep an SSH session open; a SLURM session ends with the job",
        "DeepSpeed PR #5481 pooled the buffers",
        "color #ffaa00 and #fff",
        "## 3. Stop signals",
        "the rounds are interleaved, each round alternating the order",
    ]
    for text in flagged:
        page.write_text(text + "\n", encoding="utf-8")
        assert hits_in(page, text + "\n"), text
    for text in fine:
        page.write_text(text + "\n", encoding="utf-8")
        assert hits_in(page, text + "\n") == [], text


def test_python_is_read_by_comments_strings_and_test_names(tmp_path):
    code = tmp_path / "mod.py"
    text = (
        "session = 1  # the POSIX session of the rank\n"
        "def test_misuse_issue31():\n"
        "    '''Tried in session 3.'''\n"
    )
    hits = hits_in(code, text)
    assert [h.split(":")[1] for h in hits] == ["2", "3"], hits


def test_docs_readme_and_code_speak_of_the_project_only():
    hits = [h for p in scanned_files() for h in hits_in(p, p.read_text(errors="replace"))]
    assert hits == [], "\n".join(hits)
