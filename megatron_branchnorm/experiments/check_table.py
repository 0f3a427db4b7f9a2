"""The table the GPU checks print (workflows/gpu_check.py, experiments/apex_layernorm.py): one
row per check, its value, its limit and a verdict, and the same rows as a --json report."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Row:
    check: str
    value: str
    limit: str = ""
    ok: bool | None = None  # None: a figure, not a check

    def verdict(self) -> str:
        return {True: "PASS", False: "FAIL", None: ""}[self.ok]


TABLE_HEADER = "| check | value | limit | verdict |\n| --- | --- | --- | --- |"

ROW_KEYS = frozenset(Row.__dataclass_fields__)
"""The keys of each row of a --json report: how one of ours is recognised."""


def format_rows(rows: list[Row]) -> str:
    return "\n".join(f"| {r.check} | {r.value} | {r.limit} | {r.verdict()} |" for r in rows)
