"""The start-up sampling table (megatron_branchnorm/data/sampling.py): usable pairs,
natural share and share at temperature T of every direction, printed and written as
SAVE_DIR/sampling.tsv. The trainer's own file is checked in tests/pipeline/test_validation.py."""

from __future__ import annotations

import pytest

from megatron_branchnorm.data.sampling import (
    SAMPLING_FILE,
    format_sampling_table,
    sampling_table,
    write_sampling_table,
)

DIRECTIONS = ["de-en", "en-de", "en-zu", "zu-en"]
COUNTS = [1_000_000, 1_000_000, 15_000, 15_000]


def test_shares_sum_to_one_and_temperature_flattens_them():
    rows = sampling_table(DIRECTIONS, COUNTS, 5.0)
    assert [r["direction"] for r in rows] == DIRECTIONS
    assert [r["pairs"] for r in rows] == COUNTS
    assert sum(r["natural"] for r in rows) == pytest.approx(1.0, abs=1e-12)
    assert sum(r["sampled"] for r in rows) == pytest.approx(1.0, abs=1e-12)
    assert rows[0]["natural"] == pytest.approx(1_000_000 / 2_030_000)
    # T = 5: the small direction is up-sampled (natural 0.7%, sampled ~ 15000^0.2 / sum)
    w = [n**0.2 for n in COUNTS]
    assert rows[2]["sampled"] == pytest.approx(w[2] / sum(w))
    assert rows[2]["sampled"] > 5 * rows[2]["natural"]


def test_temperature_one_is_the_natural_share():
    rows = sampling_table(DIRECTIONS, COUNTS, 1.0)
    assert [r["sampled"] for r in rows] == pytest.approx([r["natural"] for r in rows], rel=1e-12)


def test_a_direction_without_pairs_is_never_sampled():
    rows = sampling_table(["a-en", "en-a"], [10, 0], 5.0)
    assert [(r["natural"], r["sampled"]) for r in rows] == [(1.0, 1.0), (0.0, 0.0)]
    with pytest.raises(ValueError, match="2 directions but 1 counts"):
        sampling_table(["a-en", "en-a"], [10], 5.0)


def test_the_file_and_the_console_lines(tmp_path):
    rows = sampling_table(DIRECTIONS, COUNTS, 5.0)
    path = tmp_path / SAMPLING_FILE
    write_sampling_table(path, rows)
    lines = path.read_text().splitlines()
    assert lines[0] == "direction\tpairs\tnatural\tsampled"
    assert lines[1].split("\t")[:2] == ["de-en", "1000000"]
    read = [[float(x) for x in line.split("\t")[2:]] for line in lines[1:]]
    assert sum(r[0] for r in read) == pytest.approx(1.0, abs=1e-7)
    assert sum(r[1] for r in read) == pytest.approx(1.0, abs=1e-7)
    assert list(tmp_path.iterdir()) == [path]  # no temporary left
    text = format_sampling_table(rows, 5.0)
    assert text[0] == "sampling over 4 directions at temperature 5:"
    assert "en-zu" in text[4] and "0.74%" in text[4]
    assert text[-1].split()[:2] == ["total", "2,030,000"]
