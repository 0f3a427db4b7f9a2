"""tools/plan_memory.py and megatron_branchnorm.parallel.planner: parameter counts against real layers,
the 1000L total against the paper, the bubble, the fit verdict and the CLI contract."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
import torch

from megatron_branchnorm.config import ConfigError, ModelConfig, load_config
from megatron_branchnorm.model import build_model
from megatron_branchnorm.model.layers import DecoderLayer, EncoderLayer
from megatron_branchnorm.parallel.planner import (
    ALLOCATOR_MARGIN,
    DEC_ACT_BYTES,
    ENC_ACT_BYTES,
    GB,
    auto_stages,
    decoder_layer_params,
    encoder_layer_params,
    format_plan,
    layer_activation_bytes,
    parse_memory,
    plan_run,
    total_params,
)
from tests.slurm.conftest import ROOT

PAPER_1000L_PARAMS = 3.8e9  # BranchNorm / DeepNet: 1000L (500L-500L) OPUS-100 model, 3.8B
WIDTHS = [(8, 16), (8, 24), (16, 16), (16, 40), (24, 56)]  # (d, ffn) small enough to build


def count(module) -> int:
    return sum(p.numel() for p in module.parameters())


def small(d: int, f: int, **kw) -> ModelConfig:
    return ModelConfig(hidden_size=d, ffn_hidden_size=f, num_attention_heads=2, vocab_size=40, **kw)


@pytest.mark.parametrize("residual", ["branchnorm", "preln"])
@pytest.mark.parametrize("d,f", WIDTHS)
def test_layer_counts_match_real_layers(d, f, residual):
    m = small(d, f, residual=residual)
    assert encoder_layer_params(m) == count(EncoderLayer(m, 1.0, 1.0, 1, 0))
    assert decoder_layer_params(m) == count(DecoderLayer(m, 1.0, 1.0, 1, 0))


def _fit(kind) -> np.ndarray:
    """Per-layer count as c1 d^2 + c2 d f + c3 d + c4 f, fitted on layers actually built."""
    rows, counts = [], []
    for d, f in WIDTHS:
        m = small(d, f)
        rows.append([d * d, d * f, d, f])
        counts.append(count(kind(m, 1.0, 1.0, 1, 0)))
    coef, residual, *_ = np.linalg.lstsq(np.array(rows, float), np.array(counts, float), rcond=None)
    assert residual.size == 0 or residual[0] < 1e-6  # exactly this polynomial
    return coef


def _saved_bytes(model, fn) -> int:
    """Bytes of the tensors autograd saves for the backward while ``fn`` runs ``model``
    forward, parameters left out (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "d,f,heads,rows,length,dropouts",
    [(64, 128, 4, 8, 12, (0.1, 0.0)), (96, 384, 4, 4, 30, (0.1, 0.0)),
     (64, 128, 4, 8, 12, (0.0, 0.0)), (64, 192, 4, 6, 10, (0.1, 0.1))],
)  # fmt: skip
def test_activation_estimate_is_what_the_layers_save(dtype, d, f, heads, rows, length, dropouts):
    """planner.ENC_ACT_BYTES / DEC_ACT_BYTES against the real model: what one more encoder
    (decoder) layer's training forward saves for the backward, per token, measured by
    difference of two models, in bf16 and fp32, with model.dropout / activation_dropout
    ``dropouts``. The estimate is at or above the measurement and within 1% of it (the H100
    run's peak  was 1.7x below the constants taken before from Korthikanti et al.)."""
    dropout, activation_dropout = dropouts
    drops = [f"model.dropout={dropout}", f"model.activation_dropout={activation_dropout}"]
    from megatron_branchnorm.parallel.planner import (
        DEC_ACT_BYTES,
        ENC_ACT_BYTES,
        layer_activation_bytes,
    )

    def saved(enc: int, dec: int) -> int:
        cfg = load_config("tiny_cpu", [
            *drops, f"model.encoder_layers={enc}", f"model.decoder_layers={dec}",
            f"model.hidden_size={d}", f"model.ffn_hidden_size={f}",
            f"model.num_attention_heads={heads}"]).model  # fmt: skip
        model = build_model(cfg).to(dtype)
        g = torch.Generator().manual_seed(0)
        src = torch.randint(4, cfg.vocab_size, (rows, length), generator=g)
        prev = torch.randint(4, cfg.vocab_size, (rows, length), generator=g)
        return _saved_bytes(model, lambda: model(src, prev))

    m = load_config("tiny_cpu", [*drops, f"model.hidden_size={d}", f"model.ffn_hidden_size={f}",
                                 f"model.num_attention_heads={heads}"]).model  # fmt: skip
    tokens, base = rows * length, saved(1, 1)
    act = torch.finfo(dtype).bits // 8
    for layers, per_token in (((3, 1), ENC_ACT_BYTES), ((1, 3), DEC_ACT_BYTES)):
        measured = (saved(*layers) - base) / 2 / tokens
        estimate = layer_activation_bytes(m, per_token, act)
        assert measured <= estimate <= 1.01 * measured, (layers, measured, estimate)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "d,f,heads,rows,length,dropout",
    [(64, 256, 4, 8, 32, 0.1), (96, 384, 4, 4, 30, 0.1), (64, 128, 4, 8, 12, 0.0),
     (128, 512, 4, 8, 64, 0.1)],
)  # fmt: skip
def test_a_graph_pool_holds_what_a_links_capture_allocates(
    dtype, d, f, heads, rows, length, dropout
):
    """The pool the planner sets aside for a link of a recomputing stage's graphs
    (RunPlan._pool: its layers' activations and the backward's working set,
    planner.capture_work) against the live peak of what the link's forward and
    ``torch.autograd.grad`` backward allocate, which is what its capture allocates in the pool
    (training/graph_capture.py; experiments/graph_pool.py), for links of 1 and 2 encoder or
    decoder layers: at or above it, and within 30% (the allocator's 10% margin, and a
    formula's rounding, most at 120 tokens, where a layer's weight gradients weigh as much as
    its activations). Without the working set a layer's link peaked at 1.45 times its planned
    pool (docs/performance.md)."""
    from megatron_branchnorm.experiments.graph_pool import link_peak, model_config, planned_pool

    m = model_config(d, f, heads, dropout, layers=3)
    act = torch.finfo(dtype).bits // 8
    for kind, layers in ((k, n) for k in ("enc", "dec") for n in (1, 2)):
        measured = link_peak(m, kind, layers, rows, length, dtype)
        pool = planned_pool(m, kind, layers, rows * length, act)
        assert measured <= pool <= 1.3 * measured, (kind, layers, measured, pool)


def test_the_loss_workspace_follows_the_chunked_loss():
    """The last stage's loss workspace: logits and their gradient in the activation dtype and
    one fp32 chunk of model/loss.py's size (its fp32 (N, V) buffers are gone), with
    the allocator's margin as the activations have it."""
    from megatron_branchnorm.model.loss import CHUNK_ELEMENTS
    from megatron_branchnorm.parallel.planner import ALLOCATOR_MARGIN, LOSS_CHUNK_ELEMENTS

    assert LOSS_CHUNK_ELEMENTS == CHUNK_ELEMENTS
    cfg = load_config("opus100_12L", ["model.vocab_size=64000", "pipeline.stages=1"])
    loss = plan_run(cfg, 1, 80 * GB).stage_plans[0].loss_workspace
    assert loss == pytest.approx((4096 * 64000 * 2 * 2 + CHUNK_ELEMENTS * 4) * ALLOCATOR_MARGIN)


def test_1000L_count_matches_built_model_scaled_and_the_paper():
    cfg = load_config("opus100_1000L").model
    m = dataclasses.replace(cfg, vocab_size=64000)
    # the whole 500L-500L model, built at a small width: the planner counts it exactly
    tiny = dataclasses.replace(
        m, hidden_size=8, ffn_hidden_size=16, num_attention_heads=2, vocab_size=40
    )
    assert total_params(tiny) == count(build_model(tiny))
    # scaled analytically to d=512, ffn=2048 from layers actually built
    d, f = m.hidden_size, m.ffn_hidden_size
    basis = np.array([d * d, d * f, d, f], float)
    scaled = (
        m.encoder_layers * basis @ _fit(EncoderLayer)
        + m.decoder_layers * basis @ _fit(DecoderLayer)
        + m.vocab_size * d
    )
    planned = total_params(m)
    assert abs(planned - scaled) <= 0.01 * scaled
    assert abs(planned - PAPER_1000L_PARAMS) <= 0.05 * PAPER_1000L_PARAMS
    assert f"total parameters: {planned / 1e9:.2f}B" == "total parameters: 3.71B"


def test_stage_params_sum_to_the_model_plus_tied_copies():
    cfg = load_config("opus100_1000L")
    plan = plan_run(cfg, gpus=32, gpu_memory=40 * GB)
    m = plan.model
    copies = sum(1 for s in plan.stage_plans if s.stage in (0, plan.stages - 1)) - 1
    middle = [s for s in plan.stage_plans if 0 < s.stage < plan.stages - 1]
    copies += sum(1 for s in middle if s.encoder_layers and s.decoder_layers)  # dec_embed
    assert sum(s.params for s in plan.stage_plans) == total_params(m) + copies * 64000 * 512
    assert sum(s.encoder_layers for s in plan.stage_plans) == 500
    assert sum(s.decoder_layers for s in plan.stage_plans) == 500


def test_bubble_and_fit_verdicts():
    cfg = load_config("opus100_1000L")
    a100 = plan_run(cfg, gpus=32, gpu_memory=parse_memory("40GB"))
    assert (a100.stages, a100.dp) == (16, 2)
    assert a100.bubble == pytest.approx(15 / 79)  # 64 micro-batches: 128 x 4096 tokens
    assert a100.fits() and not a100.fits(checkpointing=False)
    # ZeRO-1 halves the optimizer state when data parallelism doubles
    h100 = plan_run(cfg, gpus=8, gpu_memory=parse_memory("80GB"), stages=8)
    assert h100.bubble == pytest.approx(7 / 71)
    s16 = plan_run(cfg, gpus=16, gpu_memory=80 * GB, stages=8)
    ratio = s16.stage_plans[3].optimizer / h100.stage_plans[3].optimizer
    assert ratio == pytest.approx(0.5)
    assert plan_run(cfg, gpus=8, gpu_memory=8 * GB, stages=8).fits() is False
    assert auto_stages(cfg, 8, 80 * GB).fits()
    with pytest.raises(ConfigError, match="pipeline.stages"):
        plan_run(cfg, gpus=12, gpu_memory=80 * GB, stages=8)


def test_cli_prints_the_table_and_total(tmp_path):
    tool = str(ROOT / "tools" / "plan_memory.py")
    proc = subprocess.run(
        [sys.executable, tool, "--config", "opus100_1000L", "--gpus", "32", "--gpu-memory", "40GB"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    assert "total parameters: 3.71B" in proc.stdout
    assert "| 15 |" in proc.stdout and "pipeline bubble" in proc.stdout
    plan = plan_run(load_config("opus100_1000L"), 32, 40 * GB, config_name="opus100_1000L")
    plan = dataclasses.replace(plan, bucket_shapes=48)  # data.bucket_shapes: auto
    assert format_plan(plan) == proc.stdout.strip()
    assert "- train.max_steps = 100,000 updates: ~" in proc.stdout
    bad = subprocess.run(
        [sys.executable, tool, "--config", "opus100_1000L", "--gpus", "12"]
        + ["pipeline.fallback_stages="],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "pipeline.stages" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and "12 x 1 (128 micro-batches)" in bad.stderr
    small_gpu = subprocess.run(
        [
            sys.executable,
            tool,
            "--config",
            "opus100_1000L",
            "--gpus",
            "8",
            "--gpu-memory",
            "8GB",
            "--stages",
            "8",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert small_gpu.returncode == 1 and "does NOT fit" in small_gpu.stdout


@pytest.mark.parametrize(
    ("gpus", "layout"),
    [(16, "16 x 1 x 128"), (24, "3 x 8 x 16"), (32, "16 x 2 x 64"), (64, "16 x 4 x 32")],
)
def test_every_plan_keeps_the_recipes_tokens_per_update(capsys, tmp_path, gpus, layout):
    """opus100_1000L on 80 GB GPUs, as the launcher plans it (no --stages), with --stages auto
    and with --stages 16 where it divides: 128 x 4096 tokens per update, the paper's, whatever
    the GPU count (24 GPUs planned 1 x 24 x 64, 6,291,456 tokens, without a word)."""
    from megatron_branchnorm.commands import plan

    args = ["--config", "opus100_1000L", "--gpus", str(gpus), f"train.save_dir={tmp_path}"]
    stages, dp, micro = layout.split(" x ")
    for extra in ([], ["--stages", "auto"], ["--stages", "16"] if gpus % 16 == 0 else []):
        assert plan.main([*args, *extra]) == 0
        out = capsys.readouterr().out
        assert f"tokens per update: {128 * 4096:,} per side;" in out
        if not extra:
            assert f"= {stages} stages x {dp} data-parallel; bf16, ZeRO-1; {micro} micro" in out


def test_a_stage_count_that_cannot_share_the_batch_is_refused(capsys, tmp_path):
    """--stages 8 on 24 GPUs: 3 replicas cannot share 128 micro-batches per update."""
    from megatron_branchnorm.commands import plan

    args = ["--config", "opus100_1000L", "--gpus", "24", "--stages", "8"]
    assert plan.main([*args, f"train.save_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "its data-parallel size 3 does not divide" in err
    assert "keep 128 micro-batches per update: 3 x 8 (16 micro-batches)" in err


def test_auto_recompute_is_chosen_per_stage_by_the_plan() -> None:
    """activation_checkpoint_interval=auto: a stage recomputes exactly when its estimate
    without recompute exceeds the device (the early stages hold more micro-batches in
    flight), and the trainer's choice for each stage is the plan's."""
    from megatron_branchnorm.parallel.planner import auto_checkpoint_interval

    cfg = load_config("opus100_1000L", ["pipeline.activation_checkpoint_interval=auto"])
    plan = plan_run(cfg, 32, 40 * GB)
    chosen = [auto_checkpoint_interval(cfg, 32, s.stage, 40 * GB) for s in plan.stage_plans]
    needs = [int(s.total(False, plan.overhead) > 40 * GB) for s in plan.stage_plans]
    assert chosen == needs
    assert 0 < sum(chosen) < len(chosen)  # 1000L on 40 GB: some stages need it, some do not
    assert plan.fits() and not plan.fits(checkpointing=False)
    assert "auto (recompute where a stage does not fit without: stage(s) 0," in format_plan(plan)
    roomy = plan_run(cfg, 32, 400 * GB)
    assert not roomy.checkpointing
    fixed = load_config("opus100_1000L", ["pipeline.activation_checkpoint_interval=2"])
    assert auto_checkpoint_interval(fixed, 32, 15, 400 * GB) == 2  # a number is taken as set


def test_cli_plans_the_layout_the_trainer_takes(monkeypatch, capsys, tmp_path):
    """What the sbatch launchers run before the ranks start: on 24 GPUs the 1000L config's 16
    stages do not divide; pipeline.fallback_stages=auto picks a layout (a 3-node requeue of the
    4-node job must not die here), and a resumed run keeps its checkpoint's 128 micro-batches
    per update (training/layout.py)."""
    from megatron_branchnorm.commands import plan
    from megatron_branchnorm.training.layout import SavedBatch

    args = ["--config", "opus100_1000L", "--gpus", "24", f"train.save_dir={tmp_path}"]
    assert plan.main(args) == 0  # a fresh start keeps the config's 128 x 4096 tokens too
    out = capsys.readouterr().out
    assert out.startswith("layout: layout 3 stages x 8 data-parallel, 16 micro-batches")
    assert "pipeline.stages=16 does not divide the world size 24" in out.splitlines()[0]
    assert "= 3 stages x 8 data-parallel" in out and "tokens per update: 524,288 per side;" in out
    monkeypatch.setattr(plan, "saved_batch", lambda save_dir: SavedBatch(64, 2))
    # resumed from 16 x 2, the config without pipeline.data_parallel: the checkpoint's 128
    assert plan.main([*args, "pipeline.data_parallel=0"]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("layout: layout 3 stages x 8 data-parallel, 16 micro-batches")
    assert "the checkpoint's 128 micro-batches per update (saved at data-parallel size 2) kept" in (
        first
    )
    assert plan.main([*args[:3], "32", *args[4:]]) == 0  # the allocation it was planned for
    assert not capsys.readouterr().out.startswith("layout:")


def test_cuda_graph_rows_bound_the_graphs_by_the_memory_the_run_leaves(capsys) -> None:
    """With model.cuda_graphs on, the plan shows per stage what a graph set keeps and how many
    fit beside the planned run and the graphs' own activation pools (the trainer's bound,
    planner.graph_allowance); a stage that recomputes wants one set per shape."""
    from megatron_branchnorm.commands import plan as plan_command
    from megatron_branchnorm.parallel.planner import MAX_GRAPHS, graph_allowance

    cfg = load_config("opus100_1000L")
    plan = dataclasses.replace(plan_run(cfg, gpus=32, gpu_memory=80 * GB), graph_shapes=48)
    tokens, m = plan.micro_batch_tokens, plan.model
    layer = {  # one micro-batch's activations of one layer
        kind: tokens * layer_activation_bytes(m, per_token, 2) * ALLOCATOR_MARGIN
        for kind, per_token in (("enc", ENC_ACT_BYTES), ("dec", DEC_ACT_BYTES))
    }
    for s in plan.stage_plans:
        allowance = graph_allowance(cfg, 32, s.stage, 80 * GB, 48)
        assert allowance == plan.graph_allowance(s)
        recomputes = plan.stage_checkpoints(s)
        # what a pool holds beside activations: the backward's working set, two FFN hidden
        # states' gradients and the FFN's two weights' gradients (bf16), with the margin
        assert s.capture_work == pytest.approx(2 * (tokens + 512) * 2048 * 2 * ALLOCATOR_MARGIN)
        if recomputes:  # one pool: one micro-batch's activations of its larger range
            assert plan.link_layers(s) == 0  # 80 GB: room for whole ranges
            pool = max(s.encoder_layers * layer["enc"], s.decoder_layers * layer["dec"])
            free = 80 * GB - s.total(True, plan.overhead) - pool - s.capture_work
        else:  # each slot's pool holds its in-flight micro-batch's activations
            free = 80 * GB - s.total(False, plan.overhead) - s.act_no_ckpt
            free -= s.in_flight * s.capture_work
        assert allowance == pytest.approx(max(0.0, free))
        wanted, fit = plan.graph_sets(s)
        assert wanted == 48 * (1 if recomputes else s.in_flight)
        room = max(allowance - s.graph_grad_bytes, 0.0)
        assert fit == min(int(room // s.graph_set_bytes), MAX_GRAPHS // s.layer_ranges, wanted)
    # the shared gradient buffers are the stage's weights' size once (bf16); a graph set
    # keeps its hidden states in and out and their gradients: 4 x 4,096 tokens x 512 x 2 bytes
    assert plan.stage_plans[3].graph_grad_bytes == plan.stage_plans[3].params * 2
    assert plan.stage_plans[3].graph_set_bytes == 4 * 4096 * 512 * 2 + 2 * 4096 * 8
    assert plan_command.main(["--config", "opus100_1000L", "--gpus", "32"]) == 0
    assert "CUDA graphs (model.cuda_graphs on" not in capsys.readouterr().out  # off: no graph rows
    argv = ["--config", "opus100_1000L", "--gpus", "32", "model.cuda_graphs=on"]
    assert plan_command.main(argv) == 0
    out = capsys.readouterr().out
    assert "CUDA graphs (model.cuda_graphs on, up to 48 bucket shapes" in out
    assert "| 0 | 1 (recomputes for them) | 0.017 | 0.47 | 62.31 | 48 | 48 |" in out
    assert "| 14 | 2 (in flight) | 0.025 | 0.46 | 53.70 | 96 | 96 |" in out
    # a recompute set by number is taken as set: stage 3 then keeps its 13 in flight, and
    # its graphs find no room beside their second copy of the activations
    assert plan_command.main([*argv, "pipeline.activation_checkpoint_interval=0"]) == 0
    assert "| 3 | 13 (in flight) | 0.017 | 0.47 | 0.00 | 624 | 0 |" in capsys.readouterr().out
    # on 40 GB stage 0 recomputes because it must
    assert plan_command.main([*argv, "--gpu-memory", "40GB"]) == 0
    assert "| 0 | 1 (recomputes) | 0.017 | 0.47 | 22.31 | 48 | 48 |" in capsys.readouterr().out


def test_auto_recompute_lets_each_stage_graph_every_micro_batch() -> None:
    """Under activation_checkpoint_interval=auto with CUDA graphs, a stage that fits without
    recompute still recomputes when its graphs then replay enough more of its (shape,
    micro-batch in flight) pairs to make it faster (planner.RunPlan.graphs_pay): opus100_1000L on
    32 x 40 GB graphed only stages 0-9 (they must recompute) and 14-15 fully, 10-12 not at all
    and 13 in part, and now every stage; the trainer's choice per stage is the plan's, with or
    without graphs."""
    from megatron_branchnorm.parallel.planner import auto_checkpoint_interval

    cfg = load_config("opus100_1000L")
    assert cfg.pipeline.activation_checkpoint_interval == "auto"
    eager = plan_run(cfg, 32, 40 * GB)
    graphed = dataclasses.replace(eager, graph_shapes=48)
    memory = [s.stage for s in eager.stage_plans if eager.stage_checkpoints(s)]
    assert memory == list(range(10))  # without graphs: where a stage does not fit without
    for s in graphed.stage_plans:
        without = graphed._graph_sets(s, recompute=False)
        wanted, fit = graphed.graph_sets(s)
        assert fit == wanted  # every stage graphs all it runs
        assert graphed.recomputes_for_graphs(s) == (
            s.stage not in memory and without[1] < without[0]
        )
        assert graphed.stage_checkpoints(s) == (s.stage <= 13)
        assert auto_checkpoint_interval(cfg, 32, s.stage, 40 * GB, 48) == int(s.stage <= 13)
        assert auto_checkpoint_interval(cfg, 32, s.stage, 40 * GB) == int(s.stage in memory)
    # recompute only lowers the peak, so the plan still fits; the summary names both reasons
    assert graphed.fits() and graphed.peak() <= eager.peak()
    assert (
        "auto (recompute where a stage does not fit without: stage(s) 0, 1, 2, 3, 4, 5, 6, 7, 8, "
        "9; where it is then faster with its CUDA graphs: stage(s) 10, 11, 12, 13)"
    ) in format_plan(graphed)
    # a tie keeps the cheaper way: one stage, one micro-batch in flight, room for every graph
    single = load_config("opus100_12L", ["pipeline.stages=1"])
    one = dataclasses.replace(plan_run(single, 1, 80 * GB), graph_shapes=48)
    assert one.graph_sets(one.stage_plans[0]) == (48, 48)
    assert not one.stage_checkpoints(one.stage_plans[0])


def test_param_tensors_and_stage_flops_are_the_models() -> None:
    """The time model's counts: a layer's parameter tensors (each hands its gradient over once
    per micro-batch) are the real layers', and the stages' FLOPs per micro-batch add up to the
    whole model's training_flops (what train.py logs) at the same tokens."""
    from megatron_branchnorm.parallel.planner import (
        MEAN_SENTENCE_TOKENS,
        PARAM_TENSORS,
        training_flops,
    )

    m = small(16, 40)
    assert PARAM_TENSORS["enc"] == len(list(EncoderLayer(m, 1.0, 1.0, 1, 0).parameters()))
    assert PARAM_TENSORS["dec"] == len(list(DecoderLayer(m, 1.0, 1.0, 1, 0).parameters()))
    for stages in (1, 3, 16):
        plan = plan_run(load_config("opus100_1000L"), stages, 80 * GB, stages=stages)
        n = plan.micro_batch_tokens
        whole = training_flops(plan.model, n, n, n / MEAN_SENTENCE_TOKENS)
        assert sum(s.flops for s in plan.stage_plans) == pytest.approx(whole, rel=1e-12)
        assert plan.flops_per_update == pytest.approx(whole * plan.micro_batches * plan.dp)
        # recompute repeats the layers' forward, not the output projection of the last stage
        last = plan.stage_plans[-1]
        output = training_flops(dataclasses.replace(plan.model, encoder_layers=0, decoder_layers=0),
                                n, n, n / MEAN_SENTENCE_TOKENS)  # fmt: skip
        assert last.recompute_flops == pytest.approx((last.flops - output) / 3)


def test_update_time_is_paced_by_the_slowest_stage() -> None:
    """planner.RunPlan.seconds_per_update: each stage's micro-batch once and m - 1 more of the
    slowest; a stage's micro-batch takes the slower of its GPU (FLOPs at --tflops, a third more
    recomputing) and its host (eager layers as the H100 ran them, twice that recomputing; the
    gradients' hand-over where graphs replay). Calibrated on the H100's eager 12L-12L update
    (108.4 ms at 4,096 tokens per side: host-bound), and on opus100_1000L the eager pipeline
    is host-bound where its CUDA graphs make it GPU-bound."""
    from megatron_branchnorm.parallel.planner import (
        EAGER_HOST_S,
        H100_EAGER_UPDATE_S,
        RECOMPUTE_HOST_FACTOR,
    )

    h100 = load_config("opus100_12L", ["model.encoder_layers=12", "model.decoder_layers=12",
                                       "pipeline.stages=1", "train.micro_batches=1"])  # fmt: skip
    one = plan_run(h100, 1, 80 * GB, vocab_size=32000)
    t = one.stage_time(one.stage_plans[0])
    assert t.host > t.gpu and one.seconds_per_update == pytest.approx(H100_EAGER_UPDATE_S)
    assert EAGER_HOST_S["dec"] > EAGER_HOST_S["enc"]  # the decoder launches more

    cfg = load_config("opus100_1000L")
    eager = plan_run(cfg, 32, 40 * GB)
    times = [eager.stage_time(s) for s in eager.stage_plans]
    m = eager.micro_batches
    assert eager.seconds_per_update == pytest.approx(
        sum(x.seconds for x in times) + (m - 1) * max(x.seconds for x in times)
    )
    for s, x in zip(eager.stage_plans, times, strict=True):
        assert x.seconds == max(x.gpu, x.host) and x.host > x.gpu  # eager: host-bound
        plain = dataclasses.replace(eager, checkpoint_interval=0).stage_time(s)
        if eager.stage_checkpoints(s):  # stages 0-9 on 40 GB recompute: their layers' forward
            assert x.gpu == pytest.approx(plain.gpu + s.recompute_flops / (eager.tflops * 1e12))
            assert s.recompute_flops == pytest.approx(s.flops / 3)  # no output projection here
            assert x.host == pytest.approx(plain.host * RECOMPUTE_HOST_FACTOR)
        else:
            assert x == plain
    graphed = eager.graphed()
    assert graphed is None  # no bucket shapes given: no graphs
    graphed = dataclasses.replace(eager, bucket_shapes=48).graphed()
    assert graphed.graph_shapes == 48
    for s in graphed.stage_plans:
        x = graphed.stage_time(s)
        assert x.gpu > x.host and x.seconds == x.gpu  # every micro-batch replays: GPU-bound
    assert graphed.seconds_per_update < eager.seconds_per_update / 4
    # equal stages: (m + p - 1) x one stage's time
    flat = dataclasses.replace(eager, stage_plans=[eager.stage_plans[1]] * eager.stages,
                               checkpoint_interval=0)  # fmt: skip
    per = flat.stage_time(eager.stage_plans[1]).seconds
    assert flat.seconds_per_update == pytest.approx((m + eager.stages - 1) * per)


def test_graphs_that_cover_part_of_a_stage_pace_each_micro_batch_by_its_own_bound() -> None:
    """Micro-batches a stage's graphs do not cover run eagerly at the host's pace, the others
    at the GPU's: the stage's time is their mix, not the slower of an averaged host and the
    GPU (which would hide the eager ones under the GPU's time)."""
    cfg = load_config("opus100_12L", ["pipeline.stages=1"])
    plan = dataclasses.replace(plan_run(cfg, 1, 80 * GB), graph_shapes=48)
    stage = plan.stage_plans[0]
    wanted, fit = plan.graph_sets(stage)
    assert fit == wanted == 48
    # make half the graph sets fit: a set as large as half the room for them
    room = plan.graph_allowance(stage) - stage.graph_grad_bytes
    half = dataclasses.replace(stage, graph_set_bytes=room / 24)
    plan = dataclasses.replace(plan, stage_plans=[half])
    assert plan.graph_sets(half) == (48, 24)
    eager = dataclasses.replace(plan, graph_shapes=0).stage_time(half)
    x = plan.stage_time(half)
    assert x.gpu == eager.gpu and eager.host > 2 * eager.gpu
    graphed = 2 * x.host - eager.host  # x.host: the mean of the graphed and the eager host
    assert 0 < graphed < x.gpu
    assert x.seconds == pytest.approx(0.5 * x.gpu + 0.5 * eager.host)
    assert x.seconds > max(x.gpu, x.host)


def test_a_stage_recomputes_for_its_graphs_only_where_that_is_faster() -> None:
    """Under auto with CUDA graphs, a stage that fits either way recomputes where its
    micro-batch is then faster by the planner's time (planner.RunPlan.graphs_pay): one whose
    graphs cover 93 of its 96 (shape, micro-batch) pairs without recompute and all 48 with it
    does not (3% eager costs less than a third more GPU work on every micro-batch), one whose
    graphs cover 48 of 96 does; on every shipped recipe the choice is the faster one."""
    cfg = load_config("opus100_200L")
    plan = dataclasses.replace(plan_run(cfg, 8, 80 * GB), graph_shapes=48)
    stage = plan.stage_plans[6]
    assert stage.in_flight == 2 and not plan._must_recompute(stage)
    for fit, recomputes in ((93, False), (48, True)):
        room = plan._allowance(stage, False) - stage.graph_grad_bytes
        tight = dataclasses.replace(stage, graph_set_bytes=room / (fit + 0.5))
        tried = dataclasses.replace(plan, stage_plans=[*plan.stage_plans[:6], tight])
        assert tried._graph_sets(tight, False) == (96, fit)
        assert tried._graph_sets(tight, True) == (48, 48)
        assert tried.stage_checkpoints(tight) is recomputes
    for name, gpus, memory in (("opus100_200L", 8, 80), ("opus100_1000L", 32, 80),
                               ("opus100_1000L", 32, 40)):  # fmt: skip
        graphed = dataclasses.replace(
            plan_run(load_config(name), gpus, memory * GB), graph_shapes=48
        )
        for s in graphed.stage_plans:
            if graphed._must_recompute(s):
                continue
            times = [graphed._stage_time(s, r, graphed.tflops).seconds for r in (False, True)]
            assert graphed.stage_checkpoints(s) == (times[1] < times[0])
            assert graphed.stage_time(s).seconds == min(times)
    # the choice is the trainer's whatever rate the time is shown at (--tflops)
    fast = dataclasses.replace(graphed, tflops=1000.0)
    assert [fast.stage_checkpoints(s) for s in fast.stage_plans] == [
        graphed.stage_checkpoints(s) for s in graphed.stage_plans
    ]


def test_stages_auto_shows_every_layout_with_its_time(capsys, tmp_path) -> None:
    """plan_memory --stages auto takes the fewest stages that fit (planner.auto_stages) and
    lists every layout it tried with its peak and its time per update, eagerly and with CUDA
    graphs, and the fastest that fits each way. On 32 x 40 GB opus100_1000L, 2 x 16 is taken
    and is the fastest with graphs too: its stages of 566 and 434 layers recompute, and have no
    room for a pool of a whole range's activations (before links, their graphs covered no
    micro-batch and 4 x 8 was 6 times as fast), but do for links of ~125 layers."""
    from megatron_branchnorm.commands import plan as plan_command
    from megatron_branchnorm.parallel.planner import layout_plans

    argv = ["--config", "opus100_1000L", "--gpus", "32", "--gpu-memory", "40GB",
            "--stages", "auto", f"train.save_dir={tmp_path}"]  # fmt: skip
    assert plan_command.main(argv) == 0
    out = capsys.readouterr().out
    cfg = load_config("opus100_1000L", [f"train.save_dir={tmp_path}"])
    plans = layout_plans(cfg, 32, 40 * GB, per_update=128)
    assert [(p.stages, p.dp) for p in plans] == [(1, 32), (2, 16), (4, 8), (8, 4), (16, 2),
                                                 (32, 1)]  # fmt: skip
    taken = auto_stages(cfg, 32, 40 * GB, 128)
    assert (taken.stages, taken.dp) == (2, 16) and "| 2 x 16 (taken) | 8 | 24.92 |" in out
    assert "| 1 x 32 | 4 | 40.02 (does not fit) |" in out
    fits = [dataclasses.replace(p, bucket_shapes=48) for p in plans if p.fits()]
    eager = min(fits, key=lambda p: p.seconds_per_update)
    graphed = min(fits, key=lambda p: p.graphed().seconds_per_update)
    assert (graphed.stages, graphed.dp) == (2, 16)
    assert graphed.graphed().seconds_per_update < taken.seconds_per_update / 4
    with_graphs = graphed.graphed()
    for s in with_graphs.stage_plans:  # every shape graphed, in links of a range's ~quarter
        longest = max(s.encoder_layers, s.decoder_layers)
        assert 0 < with_graphs.link_layers(s) < longest / 2
        assert with_graphs.graph_sets(s) == (48, 48)
        whole = dataclasses.replace(with_graphs, graph_shapes=48)
        assert whole._sets(s, True, 0)[1] == 0  # a whole range's pool: no room
    assert (
        f"the fastest that fits: eager {eager.stages} x {eager.dp} "
        f"(~{eager.seconds_per_update:.3g} s); with CUDA graphs 2 x 16 "
        f"(~{graphed.graphed().seconds_per_update:.3g} s)"
    ) in out
