"""The data benchmark's parts: the /proc sampler, the projection and the table."""

from __future__ import annotations

import subprocess
import sys

import pytest

from megatron_branchnorm.experiments.bench_data import (
    TreeSampler,
    format_table,
    linear_fit,
    projection,
    train_projection,
)

ALLOC = """
import os, sys, time
block = bytearray(os.urandom(1)) * ({mb} << 20)  # touched: resident
print("ready", flush=True)
time.sleep(1.0)
"""


def test_sampler_sees_a_childs_allocation() -> None:
    parent = subprocess.Popen(
        [sys.executable, "-c",
         "import subprocess, sys; subprocess.run([sys.executable, '-c', sys.argv[1]])",
         ALLOC.format(mb=300)],
        stdout=subprocess.PIPE,
    )  # fmt: skip
    with TreeSampler(parent.pid, interval=0.05) as sampler:
        parent.wait(timeout=30)
    assert sampler.samples > 5
    assert 300 < sampler.peak_mb < 300 + 200  # the block plus two interpreters


def test_sampler_groups_by_key() -> None:
    child = subprocess.Popen([sys.executable, "-c", ALLOC.format(mb=150)])
    key = {child.pid: "rank0"}
    with TreeSampler(child.pid, interval=0.05, group=lambda p: key.get(p.pid)) as sampler:
        child.wait(timeout=30)
    assert 150 < sampler.own_peaks["rank0"] <= sampler.peaks["rank0"] < 150 + 100
    assert "rank0" in sampler.created


def test_linear_fit_and_projection() -> None:
    assert linear_fit([1.0], [2.0]) is None
    slope, icpt = linear_fit([0.0, 1.0, 2.0], [1.0, 3.0, 5.0])
    assert slope == pytest.approx(2.0) and icpt == pytest.approx(1.0)
    rows = {
        "1000000": {"wall_s": 100.0, "sampled_peak_rss_mb": 5000.0},
        "2000000": {"wall_s": 150.0, "sampled_peak_rss_mb": 6000.0},
        "3000000": {"error": "x"},
    }
    proj = projection(rows, target=10_000_000)
    assert proj["wall_s"]["at_target"] == pytest.approx(550.0)
    assert proj["peak_rss_mb"]["per_million"] == pytest.approx(1000.0)


def test_table_has_every_row() -> None:
    rank = {
        "process_start_s": 1.0, "data_ready_s": None, "first_update_s": 9.0,
        "peak_rss_mb_first_update": 400.0, "peak_rss_mb": 450.0,
        "peak_rss_mb_with_children": 900.0, "peak_rss_mb_with_children_first_update": 900.0,
        "child_processes": ["cc1plus"],
    }  # fmt: skip
    res = {
        "checkout": "/x", "stats_flag": True, "vocab_size": 64000, "workers": 2,
        "preprocess": {
            "250000": {
                "wall_s": 50.0, "sampled_peak_rss_mb": 3000.0, "load_after": "1 1 1",
                "stats": {"phases": {"read_clean": {"seconds": 5.0, "peak_rss_mb": 900.0}},
                          "peak_rss_mb": 2900.0},
            },
            "1000000": {"error": "RuntimeError: boom"},
        },
        "train": {
            "250000/2dp_x_1stage": {
                "launch_to_first_update_s": 10.0, "peak_rss_mb_all_ranks": 1000.0,
                "per_rank": {"rank0": rank, "rank1": rank},
            },
            "250000/1dp_x_4stage": {"error": "RuntimeError: no"},
        },
        "projection": projection({}),
    }  # fmt: skip
    two = {**res["train"], "1250000/2dp_x_1stage": res["train"]["250000/2dp_x_1stage"]}
    res["train_projection"] = train_projection(two, target=2_250_000)
    assert res["train_projection"]["2dp_x_1stage"]["at_target"] == pytest.approx(450.0)
    text = format_table(res)
    assert "read_clean 5 / 900" in text and "RuntimeError: boom" in text
    assert text.count("250000/2dp_x_1stage") == 3 and "RuntimeError: no" in text
    assert "largest rank's peak at 2dp_x_1stage" in text
