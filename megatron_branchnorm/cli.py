"""What every entry point shares: one-line errors, Ctrl-C, and outputs that never eat inputs.

- :func:`run_main` runs a ``main(argv) -> int``, once per command: a
  :class:`~megatron_branchnorm.errors.UserError` (every error type a user's input or
  environment can cause derives from it) or an ``OSError`` (a missing file, a full disk, a file
  where a directory should be) becomes ``error: <one line>`` on stderr and exit 2; Ctrl-C
  becomes one line and exit 130; any other exception is a bug and keeps its traceback.
  Writers publish by renaming a finished temporary file or directory, so an interrupt leaves
  nothing half-written that looks complete.
- :class:`ArgumentParser`, :func:`int_flag` and :func:`float_flag`: a bad command line is one
  line and exit 2 too.
- How outputs are written (never over an input, published by renaming a finished temporary)
  is formats/outputs.py's; what an error repeats of a user's value, formats/files.py's
  (``quote``). Only the front doors (commands/, workflows/, experiments/, train.py) import
  this module.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import NoReturn

from megatron_branchnorm.errors import UserError
from megatron_branchnorm.formats.files import MAX_INT, one_line, quote
from megatron_branchnorm.formats.outputs import describe_os_error

EXIT_BAD_INPUT = 2
"""Exit code of every entry point for bad input (a one-line error)."""
EXIT_INTERRUPTED = 130
"""Exit code after Ctrl-C (128 + SIGINT), as shells report it."""


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back while the block runs, then deliver it: for importing torch,
    NumPy and DeepSpeed, whose imports swallow a KeyboardInterrupt in places and leave a
    half-initialised module behind (seen: NumPy without ``multiply``, a traceback, exit 1).
    The interrupt then ends the command cleanly through :func:`run_main` (exit 130). Threads
    started inside the block keep SIGINT blocked; the main thread gets it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def run_main(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """``main(argv)``, with a :class:`UserError` or an ``OSError`` as one line ``error: ...`` and
    exit 2 and Ctrl-C as one line and exit 130; any other exception (a bug) propagates with its
    traceback. Every command and workflow runs its ``main`` through this exactly once, with its
    imports inside ``main`` where they are slow (Ctrl-C during them is exit 130 too)."""
    try:
        return main(argv)
    except KeyboardInterrupt:
        print("interrupted (Ctrl-C): nothing half-written was kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    except OSError as exc:
        print(f"error: {describe_os_error(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except UserError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return EXIT_BAD_INPUT


# --------------------------------------------------------------------------------------------
# Command lines
# --------------------------------------------------------------------------------------------


class UsageError(UserError, ValueError):
    """A bad command line (unknown flag, a number out of range): a one-line message."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose errors raise :class:`UsageError` (one line and exit 2 through
    :func:`megatron_branchnorm.cli.run_main`) instead of printing the usage block."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def int_flag(low: int, high: int = MAX_INT) -> Callable[[str], int]:
    """argparse ``type=``: an integer in [low, high]; argparse names the flag."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {quote(text)}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{low}, {high}], got {quote(text)}"
            )
        return value

    return parse


def float_flag(low: float = -math.inf, high: float = math.inf) -> Callable[[str], float]:
    """argparse ``type=``: a finite number in [low, high]; argparse names the flag."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {quote(text)}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {quote(text)}")
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be in [{low:g}, {high:g}], got {quote(text)}")
        return value

    return parse
