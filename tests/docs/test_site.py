"""The docs site builds: ``mkdocs build --strict`` (a broken link or anchor, a page missing
from the navigation, any warning fails it), and no hand-written page is over 400 lines."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_LINES = 400


def test_every_page_is_at_most_400_lines():
    pages = list((ROOT / "docs").rglob("*.md"))
    assert any(p.parent.name == "reference" for p in pages)
    long = {
        str(p.relative_to(ROOT)): n
        for p in pages
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}, f"pages over {MAX_LINES} lines (split them): {long}"


def test_mkdocs_build_strict_passes_without_warnings(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # the theme's banner
    )
    log = run.stdout + run.stderr
    warnings = [line for line in log.splitlines() if "WARNING" in line or "ERROR" in line]
    assert run.returncode == 0 and warnings == [], log[-4000:]
    assert (site / "index.html").is_file()
    assert (site / "search" / "search_index.json").is_file()
    shutil.rmtree(site)
