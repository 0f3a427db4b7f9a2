"""tools/analyze_model.py and experiments/analysis.py: ranges, known values on
constructed models, padding invariance, the CLI and its one-line errors."""

from __future__ import annotations

import json

import pytest
import torch

from megatron_branchnorm.experiments import analyze_model
from megatron_branchnorm.experiments.analysis import analyze, format_table, pad_batch, shown_layers
from megatron_branchnorm.model import build_model

from .helpers import tiny_config
from .test_evaluate import make_data_dir


def random_batches(vocab: int, n: int = 2, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        pairs = []
        for _ in range(3):
            s = torch.randint(
                4, vocab, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen
            )
            t = torch.randint(
                4, vocab, (int(torch.randint(2, 8, (1,), generator=gen)),), generator=gen
            )
            pairs.append((s.tolist(), t.tolist()))
        out.append(pad_batch(pairs))
    return out


@pytest.mark.parametrize("residual", ["postln", "preln", "deepnorm", "branchnorm"])
def test_ranges_and_shapes(residual):
    model = build_model(tiny_config(residual=residual, encoder_layers=3, decoder_layers=2), 1)
    stats = analyze(model, random_batches(40))
    for stack, depth in (("encoder", 3), ("decoder", 2)):
        assert len(stats[stack]["cosine"]) == len(stats[stack]["sparsity"]) == depth
        assert all(-1.0 <= c <= 1.0 for c in stats[stack]["cosine"])
        assert all(0.0 <= s <= 1.0 for s in stats[stack]["sparsity"])
    assert stats["nll"] > 0 and stats["target_tokens"] > 0
    # hooks are removed and the mode restored
    for layer in list(model.encoder_layers) + list(model.decoder_layers):
        assert not layer._forward_hooks and not layer.ffn.fc1._forward_hooks
    assert model.training


def test_known_values_on_constructed_models():
    model = build_model(tiny_config(residual="preln"), 1).eval()
    with torch.no_grad():
        for layer in list(model.encoder_layers) + list(model.decoder_layers):
            layer.ffn.fc1.weight.zero_()
            layer.ffn.fc1.bias.fill_(-1.0)  # every ReLU input negative: sparsity 1
            for _, sublayer in layer.blocks():  # zero branches: Pre-LN layers are identities
                sublayer.output_projection().weight.zero_()
                sublayer.output_projection().bias.zero_()
    stats = analyze(model, random_batches(40))
    for stack in ("encoder", "decoder"):
        assert stats[stack]["sparsity"] == [1.0, 1.0]
        assert stats[stack]["cosine"] == pytest.approx([1.0, 1.0], abs=1e-12)
    with torch.no_grad():
        for layer in list(model.encoder_layers) + list(model.decoder_layers):
            layer.ffn.fc1.bias.fill_(1.0)  # every ReLU input positive: sparsity 0
    stats = analyze(model, random_batches(40))
    assert stats["encoder"]["sparsity"] == [0.0, 0.0] == stats["decoder"]["sparsity"]


def test_padding_does_not_change_the_statistics():
    model = build_model(tiny_config(residual="branchnorm", branchnorm_steps=10), 1)
    src, prev, tgt = pad_batch([([5, 6, 7, 3], [8, 9, 10])])
    pad = torch.zeros(1, 4, dtype=torch.long)
    padded = (torch.cat([src, pad], 1), torch.cat([prev, pad], 1), torch.cat([tgt, pad], 1))
    a, b = analyze(model, [(src, prev, tgt)]), analyze(model, [padded])
    # fp32: a longer (padded) batch may take other kernels, so sums differ in the last bits
    # (1e-8 relative seen on an AVX2-only CPU); padding itself would change them far more.
    for stack in ("encoder", "decoder"):
        for key in ("cosine", "sparsity"):
            assert a[stack][key] == pytest.approx(b[stack][key], abs=1e-6)
    assert a["nll"] == pytest.approx(b["nll"], rel=1e-6)


def test_table_rows():
    assert shown_layers(6) == list(range(6))
    assert shown_layers(500) == list(range(0, 500, 42)) + [499]
    stats = {s: {"cosine": [0.5, 0.25], "sparsity": [0.1, 0.2]} for s in ("encoder", "decoder")}
    text = format_table([("a", {**stats, "nll": 1.0}), ("b", {**stats, "nll": 2.0})])
    assert "| encoder | 2 | 0.250 | 0.250 | 0.200 | 0.200 |" in text
    assert "| decoder | mean cos | 0.375 | 0.375 |" in text and "b 2.000" in text


def test_cli_table_png_json(tmp_path, text_export, capsys):
    data = make_data_dir(tmp_path)
    out_png, out_json = tmp_path / "a.png", tmp_path / "a.json"
    argv = [str(text_export), str(text_export), "--data", str(data), "--labels", "x,y"]
    code = analyze_model.main(
        [*argv, "--output", str(out_png), "--json", str(out_json), "--max-sentences", "4"]
    )
    stdout = capsys.readouterr().out
    assert code == 0, stdout
    assert "| encoder | 1 |" in stdout and "cos x" in stdout and "sparsity y" in stdout
    assert out_png.stat().st_size > 1000
    report = json.loads(out_json.read_text())
    assert report["x"]["sentences"] == {"de-en": 4, "en-de": 4, "en-zh": 4, "zh-en": 4}
    assert report["x"]["encoder"] == report["y"]["encoder"]
    assert report["x"]["scheme"] == "branchnorm"


def test_cli_errors(tmp_path, text_export, capsys):
    main = analyze_model.main
    data = make_data_dir(tmp_path)
    not_export = tmp_path / "empty"
    not_export.mkdir()
    cases = [
        ([str(tmp_path / "nope"), "--data", str(data)], "nope"),
        ([str(not_export), "--data", str(data)], "export.json"),
        ([str(text_export), "--data", str(tmp_path / "none")], "manifest.json"),
        ([str(text_export), "--data", str(data), "--split", "valid"], "valid"),
        ([str(text_export), "--data", str(data), "--labels", "a,b"], "--labels"),
        ([str(text_export), "--data", str(data), "--max-sentences", "0"], "--max-sentences"),
    ]
    for argv, needle in cases:
        code = main([*argv, "--output", str(tmp_path / "x.png")])
        err = capsys.readouterr().err
        assert code == 2 and needle in err and len(err.strip().splitlines()) == 1, err
