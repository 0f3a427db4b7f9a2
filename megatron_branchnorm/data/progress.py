"""Preprocessing's progress bars: tqdm on stderr, shown on a terminal unless told otherwise
(``--no-progress``), so that the passes' output files and stdout never carry them."""

from __future__ import annotations

import sys
from typing import Any

from tqdm import tqdm


def show_progress(progress: bool | None) -> bool:
    """Whether to show progress: ``progress``, or None for "only when stderr is a terminal"."""
    return sys.stderr.isatty() if progress is None else progress


def progress_bar(progress: bool | None, **kw: Any) -> tqdm:
    """A tqdm bar on stderr (``kw``: tqdm's options), disabled unless :func:`show_progress`."""
    return tqdm(file=sys.stderr, disable=not show_progress(progress), **kw)
