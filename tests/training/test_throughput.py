"""What train.py's rows say of its speed: ``tokens_per_sec`` and ``tflops_per_gpu``, the model
FLOPs of the update's real tokens (planner.training_flops) per second per GPU of the run."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from megatron_branchnorm.config import load_config
from megatron_branchnorm.experiments.bench_models import model_flops
from megatron_branchnorm.model.encoder_decoder import build_model
from megatron_branchnorm.parallel.planner import training_flops
from megatron_branchnorm.training import metrics
from megatron_branchnorm.training.metrics import MetricsLog, Progress, UpdateFigures


@pytest.mark.parametrize("layers", [(2, 3), (2, 2)])
def test_training_flops_are_what_torch_counts_in_the_model(layers) -> None:
    """The formula against torch's FLOP counter over the real model's forward and backward
    (attention through SDPA's math kernel, whose matmuls the counter sees): every weight
    matmul, attention scores and values, the output projection; equal to the last FLOP."""
    enc, dec = layers
    cfg = load_config(
        "tiny_cpu",
        ["model.dropout=0.0", f"model.encoder_layers={enc}", f"model.decoder_layers={dec}"],
    ).model
    model = build_model(cfg)
    rows, src, tgt = 3, 7, 5
    g = torch.Generator().manual_seed(0)
    src_tokens = torch.randint(4, cfg.vocab_size, (rows, src), generator=g)
    prev = torch.randint(4, cfg.vocab_size, (rows, tgt), generator=g)
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(src_tokens, prev).float().sum().backward()
    counted = counter.get_total_flops()
    assert counted > 0
    assert training_flops(cfg, rows * src, rows * tgt, rows) == counted
    if enc == dec:  # the benchmarks' formula is the same one
        assert (
            model_flops(enc, cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size, rows, src, tgt)
            == counted
        )


def test_a_row_gives_model_tflops_per_gpu_since_the_last_row(tmp_path, monkeypatch) -> None:
    """Two updates of 8 TFLOP each in 2 s on 4 GPUs: 2 TFLOP/s per GPU in the row and the
    console line; the next row counts from there."""
    now = [100.0]
    monkeypatch.setattr(metrics.time, "time", lambda: now[0])
    log = MetricsLog(tmp_path, is_logger=True)
    log.tb = False
    lines = []
    log.log = lines.append
    progress = Progress(log, log_interval=1, max_steps=10, max_time_minutes=0, gpus=4)
    progress.start(0)
    for _ in range(2):
        progress.count(1000, 8e12)
    now[0] = 102.0
    row = progress.write(UpdateFigures(2, 5.0, 5.0, 1e-3, 1.0, 0.5, 1.0, 16, "h", 0, 1.0))
    assert row.tokens_per_sec == 1000.0 and row.tflops_per_gpu == 2.0
    assert "| tok/s 1000 | TFLOP/s/GPU 2 |" in lines[-1]
    progress.count(500, 1e12)
    now[0] = 103.0
    row = progress.write(UpdateFigures(3, 5.0, 5.0, 1e-3, 1.0, 0.5, 1.0, 8, "h", 0, 1.0))
    assert row.tokens_per_sec == 500.0 and row.tflops_per_gpu == 0.25


def test_a_row_gives_the_allocators_reserved_peak_where_there_is_one(tmp_path) -> None:
    """memory_reserved_mb: the GPU caching allocator's peak beside the allocated one, in the
    row and the console line (fragmentation that grows over a long run shows there first);
    null on the CPU, and the console line says nothing of it there."""
    import json

    log = MetricsLog(tmp_path, is_logger=True)
    log.tb = False
    lines = []
    log.log = lines.append
    progress = Progress(log, log_interval=1, max_steps=10, max_time_minutes=0)
    progress.start(0)
    gpu = UpdateFigures(1, 5.0, 5.0, 1e-3, 1.0, 0.5, 1.0, 8, "h", 0, 9850.0, 11264.0)
    assert progress.write(gpu).memory_reserved_mb == 11264.0
    assert "| mem 9850MB (reserved 11264MB) |" in lines[-1]
    cpu = UpdateFigures(2, 5.0, 5.0, 1e-3, 1.0, 0.5, 1.0, 8, "h", 0, 600.0)
    assert progress.write(cpu).memory_reserved_mb is None
    assert "| mem 600MB | eta" in lines[-1]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("memory_reserved_mb", "absent") for r in rows if "loss" in r] == [11264.0, None]
