"""tools/fairseq_side_by_side.py without fairseq: the data export (what fairseq trains on is our
training set, tag for tag and piece for piece), the dictionary, the training arguments, parsing
fairseq's outputs, the report and the CLI's one-line errors. The fairseq run itself needs the
throwaway environment and 20+ minutes: docs/results.md has its figures."""

from __future__ import annotations

import io
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import sentencepiece as spm

from megatron_branchnorm.config import load_config
from megatron_branchnorm.data import TranslationData
from megatron_branchnorm.experiments import fairseq_side_by_side
from megatron_branchnorm.runner.steps import Status, run_logged
from megatron_branchnorm.tokens import lang_tag

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "fairseq_side_by_side.py"


@pytest.fixture(scope="module")
def sbs():
    return fairseq_side_by_side


def test_dictionary_is_our_vocabulary(sbs, small_data, tmp_path):
    data_dir, _ = small_data
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.model"))
    n = sbs.write_dictionary(sp, tmp_path / "dict.txt")
    lines = (tmp_path / "dict.txt").read_text(encoding="utf-8").splitlines()
    # fairseq adds its own <s> <pad> </s> <unk>: 4 + entries = our vocabulary size
    assert n == len(lines) == sp.get_piece_size() - 4
    assert [x.split(" ")[0] for x in lines] == [
        sp.id_to_piece(i) for i in range(4, sp.get_piece_size())
    ]
    assert all(x.endswith(" 1") for x in lines)
    assert lang_tag("de") in {x.split(" ")[0] for x in lines}


def test_export_is_our_training_set(sbs, small_data, tmp_path):
    data_dir, _ = small_data
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.model"))
    max_length = 12
    counts = sbs.export_split(data_dir, "train", tmp_path / "train", max_length, sp)
    data = TranslationData(str(data_dir), "train", max_length=max_length)
    assert data.num_too_long > 0  # the filter is exercised
    assert counts == {
        name: int(data.group_indices(g).size) for g, name in enumerate(data.directions)
    }
    src = (tmp_path / "train.src").read_text(encoding="utf-8").splitlines()
    tgt = (tmp_path / "train.tgt").read_text(encoding="utf-8").splitlines()
    assert len(src) == len(tgt) == len(data)
    k = 0
    for g, name in enumerate(data.directions):
        for i in data.group_indices(g):
            s, t = data.pair(g, int(i))
            first, *pieces = src[k].split(" ")
            assert first == lang_tag(name.split("-")[1])
            assert [sp.piece_to_id(p) for p in pieces] == s.tolist()
            assert [sp.piece_to_id(p) for p in tgt[k].split(" ")] == t.tolist()
            k += 1


def test_encode_sources_cuts_like_the_translator(sbs, small_data):
    data_dir, _ = small_data
    sp = spm.SentencePieceProcessor(model_file=str(data_dir / "spm.model"))
    long = " ".join(["Haus"] * 50)
    (short_line, long_line) = sbs.encode_sources(["Das Haus", long], "en", sp, 16)
    assert short_line.split(" ")[0] == "<2en>"
    assert sp.decode_pieces(short_line.split(" ")[1:]) == "Das Haus"
    assert len(long_line.split(" ")) == 16 - 1  # tag + pieces; fairseq adds </s>


def test_parse_interactive(sbs):
    out = "\n".join(
        [
            "S-1\t<2en> ▁b",
            "H-1\t-0.5\t▁world",
            "D-1\t-0.5\tworld",
            "P-1\t-0.1 -0.2",
            "S-0\t<2en> ▁a",
            "H-0\t-0.3\t▁hello ▁there",
            "H-2\t-1.0\t",
        ]
    )
    assert sbs.parse_interactive(out, 3) == [["▁hello", "▁there"], ["▁world"], []]
    with pytest.raises(sbs.SideBySideError, match="2 of 4 hypotheses.*input 2\\)"):
        sbs.parse_interactive(out.replace("H-2", "X-2"), 4)


def test_parse_fairseq_log_converts_bits_to_nats(sbs, tmp_path):
    log = tmp_path / "train.log"
    row = {"epoch": 1, "loss": "9.0", "num_updates": "10", "wps": "3000.5", "wall": "61"}
    valid = {"epoch": 1, "valid_loss": "8.0", "valid_nll_loss": "7.0", "valid_num_updates": "10"}
    log.write_text(
        "2026-11-23 11:00:00 | INFO | fairseq_cli.train | start\n"
        f"2026-11-23 11:00:01 | INFO | train_inner | {json.dumps(row)}\n"
        f"2026-11-23 11:00:02 | INFO | valid | {json.dumps(valid)}\n"
        "2026-11-23 11:00:03 | INFO | train_inner | {torn\n"
    )
    got = sbs.parse_fairseq_log(log)
    assert got["updates"] == 10 and got["train_s"] == 61.0 and got["words_per_s"] == 3000.5
    assert got["valid"] == [
        {"step": 10, "valid_loss": 8.0 * math.log(2), "valid_nll": 7.0 * math.log(2)}
    ]
    summary = {"epoch": 1, "train_num_updates": "12", "train_wps": "2000", "train_wall": "70"}
    with open(log, "a") as f:
        f.write(f"2026-11-23 11:00:04 | INFO | train | {json.dumps(summary)}\n")
    got = sbs.parse_fairseq_log(log)  # the run's summary row is later than the last interval
    assert got["updates"] == 12 and got["train_s"] == 70.0 and got["words_per_s"] == 2000.0
    log.write_text("nothing\n")
    with pytest.raises(sbs.SideBySideError, match="no training rows"):
        sbs.parse_fairseq_log(log)


def test_train_args_match_the_config(sbs, tmp_path):
    cfg = load_config("demo_cpu", [])
    args = sbs.fairseq_train_args(cfg, tmp_path / "bin", tmp_path / "ckpt", 20)

    def value(flag: str) -> str:
        return args[args.index(flag) + 1]

    assert value("--encoder-layers") == value("--decoder-layers") == str(cfg.model.encoder_layers)
    assert value("--encoder-embed-dim") == str(cfg.model.hidden_size)
    assert value("--max-tokens") == str(cfg.data.max_tokens)
    assert value("--update-freq") == str(cfg.train.micro_batches)
    assert float(value("--lr")) == cfg.train.lr
    assert value("--warmup-updates") == str(cfg.train.warmup_steps)
    assert float(value("--label-smoothing")) == cfg.train.label_smoothing
    assert float(value("--clip-norm")) == cfg.train.clip_grad
    assert abs(float(value("--stop-time-hours")) * 60 - 20) < 1e-3
    assert value("--arch") == "transformer" and "--share-all-embeddings" in args


def test_report_lines(sbs):
    systems = {
        "fairseq postln": {
            "training": {"updates": 700, "valid": [{"step": 700, "valid_loss": 4.75}]},
            "directions": {
                "de-en": {"bleu": 2.0, "chrf": 20.0},
                "en-de": {"bleu": 4.0, "chrf": 30.0},
            },
            "averages": {"all": 3.0},
        },
        "ours branchnorm": {
            "training": {"updates": 767, "valid": []},
            "directions": {"de-en": {"bleu": 3.8, "chrf": 18.4}},
            "averages": {"all": 3.8},
        },
    }
    lines = sbs.report_lines(systems, 20)
    assert lines[2].startswith("| system | updates | valid loss (nats) | BLEU de-en | BLEU en-de")
    assert lines[4] == "| fairseq postln | 700 | 4.75 | 2.0 | 4.0 | 3.0 | 20.0 | 30.0 | 25.0 |"
    assert lines[5] == "| ours branchnorm | 767 | - | 3.8 | - | 3.8 | 18.4 | - | 18.4 |"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--reuse", "branchnorm"], "--reuse 'branchnorm': expected SCHEME=DIR"),
        (["--minutes", "0"], "--minutes must be > 0"),
        (["--report-only"], "side_by_side.json: missing"),
    ],
)
def test_cli_errors(argv, message, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(TOOL), "--out", str(tmp_path / "o"), *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and message in proc.stderr


@pytest.mark.parametrize("expected_s, left", [(None, r"\?"), (600.0, r"~(10:00|09:5\d)")])
def test_status_line_time_left(expected_s, left, tmp_path):
    """A step shows its time left when it has a budget and "?" when it has none (never a
    made-up "~00:00" for a step still running)."""
    stream = io.StringIO()
    cmd = [sys.executable, "-c", "import time; time.sleep(1.5)"]
    run_logged(cmd, tmp_path / "log", "step", Status(stream, every_s=0.0), expected_s)
    running = [x for x in stream.getvalue().splitlines() if "elapsed" in x]
    pattern = re.compile(r"step: 00:0\d elapsed, " + left + " left$")
    assert running and all(pattern.match(x) for x in running), stream.getvalue()
    assert "step: done in" in stream.getvalue()
