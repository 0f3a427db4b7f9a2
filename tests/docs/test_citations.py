"""Every page the code cites exists: ``docs/X.md`` named in a comment, docstring or message of
the package, tools, tests, SLURM scripts or the Makefile is a file under docs/, and every
``docs/X.md §N`` (also ``§N, §M`` and ``§N.K``) has a heading whose text starts with ``N.``."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCES = ["megatron_branchnorm", "tools", "tests", "slurm"]
SUFFIXES = {".py", ".sh"}
CITE = re.compile(r"docs/(?P<page>[a-z0-9_/-]+\.md)(?P<secs>(?:,? §\d+(?:\.\d+)?)*)")
SECTION = re.compile(r"§(\d+)")
HEADING = re.compile(r"^#{1,6}\s+(\d+)\.", re.M)


def citing_files() -> list[Path]:
    files = [ROOT / "Makefile"]
    for folder in SOURCES:
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in SUFFIXES and p.is_file()]
    return sorted(f for f in files if f != Path(__file__).resolve())  # its examples aside


def citations(text: str) -> list[tuple[str, list[int]]]:
    """(page under docs/, the section numbers cited with it) of each citation in ``text``."""
    return [
        (m.group("page"), [int(n) for n in SECTION.findall(m.group("secs"))])
        for m in CITE.finditer(text)
    ]


def unresolved(files: list[Path], docs: Path) -> list[str]:
    """Each citation of ``files`` that ``docs`` does not hold, as 'file: docs/X.md §N'."""
    found = []
    for path in files:
        for page, sections in citations(path.read_text(encoding="utf-8", errors="replace")):
            target = docs / page
            where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
            if not target.is_file():
                found.append(f"{where}: docs/{page} (no such page)")
                continue
            numbers = {int(n) for n in HEADING.findall(target.read_text(encoding="utf-8"))}
            found += [f"{where}: docs/{page} §{n}" for n in sections if n not in numbers]
    return sorted(set(found))


def test_the_pattern_reads_every_form_of_citation():
    text = "see docs/design.md §1, §2 and docs/design.md §2.1; docs/performance.md; docs/a/b-c.md"
    assert citations(text) == [
        ("design.md", [1, 2]),
        ("design.md", [2]),
        ("performance.md", []),
        ("a/b-c.md", []),
    ]


def test_a_missing_page_or_section_is_reported(tmp_path):
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "design.md").write_text("# Design\n\n## 1. One\n\n### 1.1 Sub\n", encoding="utf-8")
    code = tmp_path / "code.py"
    code.write_text("# docs/design.md §1, docs/design.md §2, docs/gone.md\n", encoding="utf-8")
    assert unresolved([code], docs) == [
        "code.py: docs/design.md §2",
        "code.py: docs/gone.md (no such page)",
    ]


def test_every_cited_page_and_section_exists():
    files = citing_files()
    cited = [c for f in files for c in citations(f.read_text(encoding="utf-8", errors="replace"))]
    assert len(cited) > 100, "the citation pattern no longer finds the code's citations"
    assert unresolved(files, ROOT / "docs") == []
