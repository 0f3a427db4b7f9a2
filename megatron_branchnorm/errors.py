"""The one base of every error a user's input or environment can cause (docs/design.md §9).

A command prints a :class:`UserError` as ``error: <one line>`` and exits 2 (``cli.run_main``);
anything else is a bug and keeps its traceback. Each module's error type derives from it and
keeps its older built-in base (``ValueError``, ``RuntimeError``), so ``except ValueError``
still catches a ``ConfigError``.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input, a refused request or a failed environment, said in one line that names the
    file, key or line."""
