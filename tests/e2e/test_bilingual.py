"""A tiny bilingual task end to end, as the paper's WMT17 En->De is run: plain parallel text
with its own dev and test sets, preprocessed for the one direction en-de, trained with the
task's recipe config (wmt17_en_de_6L, narrowed for the CPU), converted, and scored with the
tokenized BLEU and compound splitting of the WMT papers, after training (evaluate.py, which
picks that scoring for an en-de DATA_DIR by default) and during it (watch_bleu.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.commands import convert as convert_cmd
from megatron_branchnorm.commands import evaluate as evaluate_cmd
from megatron_branchnorm.commands import preprocess as preprocess_cmd
from megatron_branchnorm.commands import watch_bleu as watch_cmd
from megatron_branchnorm.data.preprocess import check_directions
from megatron_branchnorm.formats.data_dir import DataError
from megatron_branchnorm.formats.records import valid_bleus
from tests.data.conftest import sentences, write_lines

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TINY = [
    "model.encoder_layers=1",
    "model.decoder_layers=1",
    "model.hidden_size=32",
    "model.ffn_hidden_size=64",
    "data.max_length=48",
    "train.max_steps=4",
    "train.save_interval=2",
    "train.eval_interval=2",
    "train.log_interval=1",
    "train.micro_batches=2",
    "pipeline.data_parallel=1",  # the recipe's 32 would take 64 micro-batches per update
    "train.patience=0",
    "data.max_tokens=512",
    "train.deepspeed_config=ds_configs/cpu_fp32.json",
]


def test_directions_are_checked():
    assert check_directions(None, ["de"], "en") == {"de-en", "en-de"}
    assert check_directions(["en-de"], ["de"], "en") == {"en-de"}
    with pytest.raises(DataError, match=r"--directions en-fr: en-fr not among the pairs' directions \(de-en, en-de\)"):  # fmt: skip
        check_directions(["en-fr"], ["de"], "en")


def test_bilingual_en_de_end_to_end(tmp_path, capsys):
    raw = tmp_path / "raw" / "de-en"
    for split, n in (("train", 300), ("dev", 10), ("test", 10)):
        write_lines(raw / f"{split}.en", sentences("en", n, len(split)))
        write_lines(raw / f"{split}.de", sentences("de", n, 7 + len(split)))
    data = tmp_path / "data"
    args = ["--format", "plain", "--input", str(tmp_path / "raw"), "--langs", "de"]
    args += ["--directions", "en-de", "--output", str(data), "--vocab-size", "120"]
    assert preprocess_cmd.main([*args, "--character-coverage", "1.0", "--no-progress"]) == 0
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["directions"] == ["en-de"]
    for split in ("train", "dev", "test"):
        assert list(manifest["splits"][split]["directions"]) == ["en-de"]
    assert list(manifest["splits"]["test"]["references"]) == ["en-de"]

    save_dir = tmp_path / "run"
    train = [sys.executable, str(ROOT / "megatron_branchnorm" / "train.py"), "--config"]
    train += ["wmt17_en_de_6L", *TINY, f"data.dataset={data}", f"train.save_dir={save_dir}"]
    proc = subprocess.run(train, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]

    search = ["--max-sentences", "6", "--beam", "2"]
    bleu = ["--bleu", "tokenized", "--compound-split", *search]
    assert watch_cmd.main(["--checkpoint", str(save_dir), *bleu]) == 0
    assert set(valid_bleus(save_dir)) == {2, 4}
    export = tmp_path / "export"
    assert convert_cmd.main(["--checkpoint", str(save_dir), "--output", str(export)]) == 0
    report = tmp_path / "test.json"
    ev = ["--model", str(export), "--data", str(data), "--split", "test", "--quiet"]
    capsys.readouterr()
    assert evaluate_cmd.main([*ev, *search, "--json", str(report)]) == 0  # the paper's scoring
    assert capsys.readouterr().out.startswith("scoring: the paper's for WMT17 En-De")
    result = json.loads(report.read_text())
    assert result["scoring"]["task"] == "wmt17_en_de"
    assert (result["scoring"]["bleu"], result["scoring"]["compound_split"]) == ("tokenized", True)
    assert list(result["directions"]) == ["en-de"]
    assert result["directions"]["en-de"]["signature"].startswith("moses-tok:de|compound-split:yes|")
    assert result["directions"]["en-de"]["chrf"] > 0
    capsys.readouterr()
