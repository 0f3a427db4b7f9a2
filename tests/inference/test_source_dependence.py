"""tools/source_dependence.py: a model that ignores its source scores true, shuffled and empty
sources alike; a real export gives finite figures; bad input is a one-line error."""

from __future__ import annotations

import math

import torch

from megatron_branchnorm.experiments import source_dependence as tool
from megatron_branchnorm.model import build_model  # noqa: E402,I001
from tests.core.helpers import tiny_config

from .test_analyze_model import random_batches
from .test_evaluate import make_data_dir


def _as_training_batches(batches):
    return [
        {"src_tokens": src, "prev_output_tokens": prev, "target": tgt} for src, prev, tgt in batches
    ]


def test_a_model_without_cross_attention_does_not_depend_on_its_source():
    model = build_model(tiny_config(residual="postln", encoder_layers=1, decoder_layers=1), 1)
    model.eval()
    batches = _as_training_batches(random_batches(40, n=3))
    res = tool.source_dependence(model, batches)
    assert len({round(v, 6) for v in res.values()}) == 3  # a random model reads its source
    for layer in model.decoder_layers:  # cut the cross-attention: the source no longer matters
        torch.nn.init.zeros_(layer.cross_attn.out.weight)
        torch.nn.init.zeros_(layer.cross_attn.out.bias)
    res = tool.source_dependence(model, batches)
    assert math.isclose(res["true"], res["shuffled"], rel_tol=1e-6)
    assert math.isclose(res["true"], res["empty"], rel_tol=1e-6)


def test_cli_errors(tmp_path, text_export, capsys):
    main = tool.main
    data = make_data_dir(tmp_path)  # references only: no indexed splits, an old manifest
    for argv, needle in (
        ([str(tmp_path / "nope"), "--data", str(data)], "nope"),
        ([str(text_export), "--data", str(data)], "manifest.json"),
        ([str(text_export), "--data", str(tmp_path / "none")], "none"),
    ):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert needle in err and len(err.strip().splitlines()) == 1, err
