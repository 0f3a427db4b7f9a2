"""Translation: the Python API and tools/translate.py on a tiny export with a tiny spm model."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_branchnorm.commands import translate as translate_cmd
from megatron_branchnorm.inference.translate import (
    SearchOptions,
    TranslateError,
    Translator,
    make_batches,
    split_lines,
)
from megatron_branchnorm.tokens import EOS_ID

from .helpers import sentences

ROOT = Path(__file__).resolve().parents[2]
TOOL = ROOT / "tools" / "translate.py"


def run_tool(*args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """tools/translate.py in a subprocess (costs a torch import: used once)."""
    return subprocess.run(
        [sys.executable, str(TOOL), *args, "--threads", "1"],
        input=stdin,
        capture_output=True,
        timeout=300,
    )


def run_main(monkeypatch, capsys, argv: list[str], stdin: bytes = b"") -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of tools/translate.py's main in this process."""
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin), encoding="utf-8"))
    try:
        code = translate_cmd.main([*argv, "--threads", "1"])
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(scope="module")
def translator(text_export) -> Translator:
    return Translator.from_export(text_export)


def test_encode_puts_target_tag_first_and_eos_last(translator):
    ids = translator.encode("  The cat\tsits.  ", "de")
    assert ids[0] == translator.tags["de"] and ids[-1] == EOS_ID
    assert ids[1:-1] == translator.sp.encode("The cat sits.")
    assert translator.languages == ["de", "en", "zh"]
    assert set(translator.tags.values()) <= set(translator.banned_ids)


def test_batched_equals_one_by_one_and_order_kept(translator):
    lines = sentences(8, seed=4)["en"]
    lines[3] = ""
    opts = SearchOptions(beam=3, max_len_a=0.5, max_len_b=3, batch_tokens=40)
    batched = translator.translate(lines, "en", "de", opts)
    single = [translator.translate([x], "en", "de", opts)[0] for x in lines]
    assert batched == single
    assert batched[3] == ""


def test_make_batches_respects_token_budget():
    lengths = [5, 9, 3, 9, 1, 7]
    batches = make_batches(lengths, 18)
    assert sorted(i for b in batches for i in b) == list(range(6))
    for b in batches:
        assert len(b) == 1 or max(lengths[i] for i in b) * len(b) <= 18
    assert make_batches([50], 10) == [[0]]


def test_unknown_language_and_bad_options_are_refused(translator):
    with pytest.raises(TranslateError, match="--tgt-lang xx: no tag <2xx>"):
        translator.translate(["hello"], "en", "xx")
    with pytest.raises(TranslateError, match="--nbest"):
        translator.translate(["hello"], "en", "de", SearchOptions(beam=2, nbest=3))


def test_invalid_utf8_names_the_line():
    assert split_lines(b"a\nb\r\nc\n", "f") == ["a", "b\r", "c"]
    with pytest.raises(TranslateError, match="f:2: invalid UTF-8"):
        split_lines(b"ok\nbad \xff\n", "f")


def test_cli_stdin_stdout_matches_api(text_export, translator):
    lines = sentences(5, seed=7)["de"]
    proc = run_tool(
        "--model",
        str(text_export),
        "--src-lang",
        "de",
        "--tgt-lang",
        "en",
        "--beam",
        "2",
        "--lenpen",
        "1.0",
        stdin="".join(x + "\n" for x in lines).encode(),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    out = proc.stdout.decode().split("\n")
    assert out[-1] == "" and len(out) == len(lines) + 1
    assert out[:-1] == translator.translate(lines, "de", "en", SearchOptions(beam=2, lenpen=1.0))


def test_cli_files_and_nbest(tmp_path, text_export, monkeypatch, capsys):
    src = tmp_path / "in.en"
    src.write_text("".join(x + "\n" for x in sentences(4, seed=9)["en"]), encoding="utf-8")
    out = tmp_path / "out.zh"
    code, _, err = run_main(
        monkeypatch,
        capsys,
        [
            "--model",
            str(text_export),
            "--src-lang",
            "en",
            "--tgt-lang",
            "zh",
            "--input",
            str(src),
            "--output",
            str(out),
            "--nbest",
            "3",
            "--beam",
            "3",
            "--max-len-a",
            "0",
            "--max-len-b",
            "5",
            "--batch-tokens",
            "16",
            "--quiet",
        ],
    )
    assert code == 0, err
    rows = [r.split("\t") for r in out.read_text(encoding="utf-8").splitlines()]
    assert len(rows) == 12
    assert [(int(r[0]), int(r[1])) for r in rows] == [(i, k) for i in range(4) for k in range(3)]
    for i in range(4):
        scores = [float(r[2]) for r in rows if int(r[0]) == i]
        assert scores == sorted(scores, reverse=True)


def test_cli_help_and_one_line_errors(tmp_path, text_export, monkeypatch, capsys):
    code, out, _ = run_main(monkeypatch, capsys, ["--help"])
    assert code == 0 and "--src-lang" in out
    cases = [
        (["--model", str(tmp_path / "nope"), "--src-lang", "de", "--tgt-lang", "en"], "nope"),
        (["--model", str(text_export), "--src-lang", "de", "--tgt-lang", "fr"], "<2fr>"),
        (
            ["--model", str(text_export), "--src-lang", "de", "--tgt-lang", "en", "--beam", "0"],
            "--beam",
        ),
        (
            [
                "--model",
                str(text_export),
                "--src-lang",
                "de",
                "--tgt-lang",
                "en",
                "--input",
                str(tmp_path / "missing.txt"),
            ],
            "missing.txt",
        ),
    ]
    for args, needle in cases:
        code, _, err = run_main(monkeypatch, capsys, args, stdin=b"hello\n")
        assert code != 0
        assert len(err.strip().splitlines()) == 1 and needle in err, err
    code, _, err = run_main(
        monkeypatch,
        capsys,
        ["--model", str(text_export), "--src-lang", "de", "--tgt-lang", "en"],
        stdin=b"fine\n\xfe\xff\n",
    )
    assert code == 2 and "<stdin>:2: invalid UTF-8" in err
