"""tools/benchmark.py's beam section on a trained export and real test sentences: the same
sentences go to our beam search and to transformers' generate, and their hypotheses agree."""

from __future__ import annotations

import argparse
import sys

import pytest

from megatron_branchnorm.experiments import benchmark as bench

from .test_evaluate import make_data_dir


def test_beam_section_on_an_export(tmp_path, text_export):
    data = make_data_dir(tmp_path, n=5)
    # A random model rarely emits EOS, so every sentence runs to its length limit, and generate
    # has one limit per batch (ours one per sentence): give each direction one source length.
    for path in (data / "raw").iterdir():
        first = path.read_text(encoding="utf-8").splitlines()[0]
        path.write_text(f"{first}\n" * 5, encoding="utf-8")
    a = argparse.Namespace(
        threads=1, beam_export=str(text_export), beam_data=str(data), beam_sentences=3,
        beam_reps=1, quick=True, base=None,
    )  # fmt: skip
    res = bench.bench_beam(a, tmp_path / "work")
    # 4 directions (de-en, en-de, en-zh, zh-en) x the first 3 test sentences
    assert res["sentences"] == 12
    assert "4 directions" in res["config"] and "2L-2L d=32" in res["config"]
    assert res["generated_tokens"]["ours"] > 0
    # same weights (the Post-LN fold of a mid-ramp BranchNorm model), same banned ids (the
    # language tags among them), same limits: the same translations, up to a float tie
    assert res["ours_at_limit"] == 12  # random weights
    assert res["same_as_hf"] >= res["sentences"] - 1
    assert res["ratio"] > 0 and len(res["times_s"]["ours"]) == 1


def test_beam_export_needs_its_data(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["benchmark.py", "--sections", "beam", "--beam-export", "x"])
    with pytest.raises(SystemExit) as exc:
        bench.main()
    assert exc.value.code == 2
    assert "--beam-export and --beam-data go together" in capsys.readouterr().err
