"""``model.compile``: each encoder/decoder layer's forward body through torch.compile
(megatron_branchnorm/model/compile.py).

Backend: inductor where a C++ compiler is found, else aot_eager (compile.default_backend, with
a warning): a machine without g++ runs every test here on aot_eager (the same graphs, run by
eager kernels), so the parity checks then hold trivially but the graph, recompile and
graph-break checks still mean what they say. ``BACKEND`` below is what this machine uses.

Tolerances (fp32, dropout 0 unless said): compiled vs eager, per tensor (outputs, input and
parameter gradients, losses), 1e-5 x the eager tensor's norm, the gradient tolerance of
docs/design.md §5. Inductor fuses pointwise ops into the reductions around them (LayerNorm
statistics, bias gradients) and sums in another order: a few fp32 roundings (1.2e-7 each) per
element; measured at most 8.5e-7 on these layers, 8.1e-7 on the engine's gradients. bf16: both eager and
compiled round to bf16 at different points (inductor keeps fused intermediates in fp32), so
they differ by bf16's resolution (2^-8), not by fp32 roundings: the compiled layer's error
against the fp32 layer must be within twice the eager bf16 layer's error plus 2^-8 (measured:
at most 1.3x).

Recompiles: ``dynamic=True`` makes (B, S, T) symbolic from the first compile, so after the
first call no batch of new sizes (>= 2), no new alpha_t and no new update compiles a graph:
the tests count graphs (``torch._dynamo.utils.counters["stats"]["unique_graphs"]``) after the
first call and require none. Without dynamic shapes the second shape compiles one more graph
(checked: that fails the shape test).

Runtime: ~100 s of CPU on 2 cores with a cold inductor cache (the C++ compiles of 10 graphs),
~35 s warm; on aot_eager ~55 s. The bf16, dropout and engine tests are marked slow.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch._dynamo.utils import counters

from megatron_branchnorm.config import ModelConfig
from megatron_branchnorm.model import compile as mbn_compile
from megatron_branchnorm.model.dropout import keep_mask
from megatron_branchnorm.model.layers import DecoderLayer, EncoderLayer
from megatron_branchnorm.model.residual import set_branch_scale, stack_constants
from megatron_branchnorm.parallel.pipeline import (
    CHECKPOINTABLE,
    DecoderLayerPipe,
    EncoderLayerPipe,
    StageBias,
)
from megatron_branchnorm.tokens import PAD_ID
from tests.core.helpers import one_rank_process_group

BACKEND = "inductor" if mbn_compile.compiler_available() else "aot_eager"
FP32_TOL = 1e-5
BF16_ULP = 2.0**-8
SHAPES = ((4, 9, 7), (3, 12, 10), (6, 5, 8))
"""(B, S, T) of successive batches: batch size, source and target lengths all change."""
WIDTH = {"hidden_size": 64, "ffn_hidden_size": 128, "num_attention_heads": 4, "vocab_size": 64}
"""tiny_cpu's width (the engine test's config): graphs compiled here serve it too."""


@pytest.fixture(scope="module", autouse=True)
def _fresh_dynamo():
    """Start and leave Dynamo's caches empty; a layer that hit the recompile limit would run
    eagerly and pass every parity check: make that an error instead."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        yield
    torch._dynamo.reset()


def _graphs() -> int:
    """Graphs compiled so far in this process."""
    return counters["stats"]["unique_graphs"]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in fp32."""
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _layers(scheme: str, compile: bool, dtype=torch.float32, **overrides):
    """Encoder and decoder layer 0 of a 2L-2L model at tiny_cpu's width (same seed: the same
    weights whether compiled or not)."""
    fields = {"dropout": 0.0, "branchnorm_steps": 8, **WIDTH, **overrides}
    cfg = ModelConfig(
        encoder_layers=2, decoder_layers=2, residual=scheme, compile=compile, **fields
    )
    (a_enc, b_enc), (a_dec, b_dec) = stack_constants(cfg)
    enc = EncoderLayerPipe(cfg, a_enc, b_enc, 7, 0).to(dtype)
    dec = DecoderLayerPipe(cfg, a_dec, b_dec, 7, 0).to(dtype)
    return cfg, enc, dec


def _batch(shape: tuple[int, int, int], seed: int):
    """x_enc (B, S, C), x_dec (B, T, C), src (B, S) with padding, and output weights."""
    b, s, t = shape
    gen = torch.Generator().manual_seed(seed)
    c = WIDTH["hidden_size"]
    src = torch.randint(PAD_ID + 4, WIDTH["vocab_size"], (b, s), generator=gen)
    src[0, -2:] = PAD_ID
    x_enc, x_dec = torch.randn(b, s, c, generator=gen), torch.randn(b, t, c, generator=gen)
    w_mem, w_out = torch.randn(b, s, c, generator=gen), torch.randn(b, t, c, generator=gen)
    return x_enc, x_dec, src, w_mem, w_out


def _step(enc, dec, batch, dtype=torch.float32) -> list[torch.Tensor]:
    """Encoder then decoder (memory = the encoder's output), forward and backward: the memory,
    the decoder output, both input gradients and every parameter gradient."""
    x_enc, x_dec, src, w_mem, w_out = batch
    for p in (*enc.parameters(), *dec.parameters()):
        p.grad = None
    xe = x_enc.to(dtype).detach().requires_grad_()
    xd = x_dec.to(dtype).detach().requires_grad_()
    memory, _, _ = enc((xe, src, src))
    out, _, _ = dec((xd, memory, src))
    ((memory.float() * w_mem).sum() + (out.float() * w_out).sum()).backward()
    grads = [p.grad for p in (*enc.parameters(), *dec.parameters())]
    return [memory.detach(), out.detach(), xe.grad, xd.grad, *grads]


# --------------------------------------------------------------------------------------------
# The option and its plumbing
# --------------------------------------------------------------------------------------------


def test_off_by_default_and_a_resume_may_switch_it():
    from megatron_branchnorm.training.resume_policy import FIXED, MAY_CHANGE

    assert ModelConfig().compile is False
    assert "model.compile" in MAY_CHANGE and "model.compile" not in FIXED
    _, enc, dec = _layers("branchnorm", False)
    assert enc.body is EncoderLayer.forward and dec.body is DecoderLayer.forward


def test_on_compiles_the_layer_bodies_with_the_same_weights():
    _, eager_enc, eager_dec = _layers("branchnorm", False)
    _, enc, dec = _layers("branchnorm", True)
    assert isinstance(enc.body, mbn_compile.CompiledBody) and enc.body.body is EncoderLayer.forward
    assert isinstance(dec.body, mbn_compile.CompiledBody) and dec.body.body is DecoderLayer.forward
    assert enc.body.dynamic and enc.body.backend == BACKEND
    # one compiled function per body, shared by every layer of a stage
    assert _layers("branchnorm", True)[1].body is enc.body
    # DeepSpeed checkpoints layers by class name; the state dict is the uncompiled layer's
    assert type(enc).__name__ in CHECKPOINTABLE and type(dec).__name__ in CHECKPOINTABLE
    for ours, ref in ((enc, eager_enc), (dec, eager_dec)):
        theirs = ref.state_dict()
        assert ours.state_dict().keys() == theirs.keys()
        assert all(torch.equal(v, theirs[k]) for k, v in ours.state_dict().items())


def test_without_a_cxx_compiler_the_backend_is_aot_eager(monkeypatch):
    monkeypatch.setattr(mbn_compile, "compiler_available", lambda: False)
    with pytest.warns(UserWarning, match="no C.. compiler"):
        assert mbn_compile.default_backend() == "aot_eager"
    monkeypatch.setattr(mbn_compile, "compiler_available", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mbn_compile.default_backend() == "inductor"


def test_the_traced_stand_in_of_keep_mask_draws_the_same_mask():
    assert mbn_compile.KEEP_MASK_TRACED  # registered with Dynamo
    for shape, p in (((7, 9), 0.1), ((3, 5, 11), 0.3), ((1, 2), 0.5), ((64, 257), 0.25)):
        torch.manual_seed(11)
        ref = keep_mask(torch.Size(shape), p)
        after = torch.randn(3)  # the generator advanced by the same amount
        torch.manual_seed(11)
        assert torch.equal(mbn_compile._keep_mask(torch.Size(shape), p), ref), (shape, p)
        assert torch.equal(torch.randn(3), after)


# --------------------------------------------------------------------------------------------
# Parity, recompiles, alpha
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scheme", ["branchnorm", "preln"])
def test_layers_match_eager_over_batch_shapes_without_recompiling(scheme):
    cfg, eager_enc, eager_dec = _layers(scheme, False)
    _, enc, dec = _layers(scheme, True)
    for module in (eager_enc, eager_dec, enc, dec):
        set_branch_scale(module, cfg, 3)
    worst, after_first = 0.0, None
    for i, shape in enumerate(SHAPES):
        batch = _batch(shape, i)
        got, ref = _step(enc, dec, batch), _step(eager_enc, eager_dec, batch)
        if after_first is None:
            after_first = _graphs()
            assert after_first >= 2  # the encoder's and the decoder's graphs, at least
        assert len(got) == len(ref)
        errs = [_rel(a, b) for a, b in zip(got, ref, strict=True)]
        worst = max(worst, *errs)
        assert max(errs) <= FP32_TOL, (scheme, shape, errs)
    print(f"{scheme} {BACKEND}: worst relative error {worst:.2e} over {len(SHAPES)} shapes")
    assert _graphs() == after_first, "a new batch shape compiled a graph"


def test_a_new_alpha_is_read_without_recompiling():
    cfg, eager_enc, eager_dec = _layers("branchnorm", False)
    _, enc, dec = _layers("branchnorm", True)
    batch = _batch(SHAPES[0], 5)
    outputs, after_first = [], None
    for step in (2, 3, 5):  # alpha_t = 2/8, 3/8, 5/8: one in-place fill of the shared tensor each
        alphas = {set_branch_scale(m, cfg, step) for m in (eager_enc, eager_dec, enc, dec)}
        assert alphas == {step / 8}
        got, ref = _step(enc, dec, batch), _step(eager_enc, eager_dec, batch)
        after_first = _graphs() if after_first is None else after_first
        assert max(_rel(a, b) for a, b in zip(got, ref, strict=True)) <= FP32_TOL, step
        outputs.append(got[1])
    assert _graphs() == after_first, "a new alpha_t compiled a graph"
    # the value is read at every call, not baked into the graph
    assert _rel(outputs[0], outputs[1]) > 1e-3 and _rel(outputs[1], outputs[2]) > 1e-3


@pytest.mark.slow
def test_bf16_layers_are_as_close_to_fp32_as_eager_bf16():
    cfg, ref_enc, ref_dec = _layers("branchnorm", False)
    _, eager_enc, eager_dec = _layers("branchnorm", False, torch.bfloat16)
    _, enc, dec = _layers("branchnorm", True, torch.bfloat16)
    for module in (ref_enc, ref_dec, eager_enc, eager_dec, enc, dec):
        set_branch_scale(module, cfg, 3)
    after_first = None
    for i, shape in enumerate(SHAPES):
        batch = _batch(shape, 20 + i)
        ref = _step(ref_enc, ref_dec, batch)
        eager = _step(eager_enc, eager_dec, batch, torch.bfloat16)
        got = _step(enc, dec, batch, torch.bfloat16)
        after_first = _graphs() if after_first is None else after_first
        assert got[0].dtype == torch.bfloat16 and got[-1].dtype == torch.bfloat16
        err_got = max(_rel(a, b) for a, b in zip(got, ref, strict=True))
        err_eager = max(_rel(a, b) for a, b in zip(eager, ref, strict=True))
        print(f"bf16 {shape}: compiled {err_got:.2e}, eager {err_eager:.2e} from fp32")
        assert err_got <= 2 * err_eager + BF16_ULP, (shape, err_got, err_eager)
    assert _graphs() == after_first


# --------------------------------------------------------------------------------------------
# Dropout: one graph, the eager masks, also when recomputed
# --------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_dropout_compiles_without_graph_breaks_and_draws_the_eager_masks():
    over = {"dropout": 0.1, "activation_dropout": 0.1}
    cfg, eager_enc, eager_dec = _layers("branchnorm", False, **over)
    _, enc, dec = _layers("branchnorm", True, **over)
    for module in (eager_enc, eager_dec, enc, dec):
        set_branch_scale(module, cfg, 3)
    x_enc, x_dec, src, _, _ = _batch(SHAPES[0], 3)
    bias = StageBias.get(src, torch.float32)
    eager_enc((x_enc, src, src))  # the LayerNorms choose their backend (outside the graph)
    explained = {
        "encoder": torch._dynamo.explain(EncoderLayer.forward)(enc, x_enc, bias),
        "decoder": torch._dynamo.explain(DecoderLayer.forward)(dec, x_dec, x_enc, bias),
    }
    for name, ex in explained.items():
        reasons = [r.reason.splitlines()[0] for r in ex.break_reasons]
        print(f"{name} with dropout: {ex.graph_count} graph, {ex.graph_break_count} breaks")
        assert (ex.graph_count, ex.graph_break_count) == (1, 0), (name, reasons)

    def run(e, d, batch, checkpoint: bool):
        if not checkpoint:
            torch.manual_seed(123)
            return _step(e, d, batch)

        # non-reentrant recompute (as the pipeline's activation checkpointing): the
        # recomputed forward must draw the masks of the first
        def both(xe, xd, src):
            memory, _, _ = e((xe, src, src))
            return memory, d((xd, memory, src))[0]

        x_e, x_d, src_, w_mem, w_out = batch
        xe, xd = x_e.clone().requires_grad_(), x_d.clone().requires_grad_()
        for p in (*e.parameters(), *d.parameters()):
            p.grad = None
        torch.manual_seed(123)
        memory, out = torch.utils.checkpoint.checkpoint(both, xe, xd, src_, use_reentrant=False)
        ((memory * w_mem).sum() + (out * w_out).sum()).backward()
        grads = [p.grad for p in (*e.parameters(), *d.parameters())]
        return [memory.detach(), out.detach(), xe.grad, xd.grad, *grads]

    no_dropout = _step(*_layers("branchnorm", False)[1:], _batch(SHAPES[1], 4))
    for i, shape in enumerate(SHAPES[1:]):
        batch = _batch(shape, 4 + i)
        ref = run(eager_enc, eager_dec, batch, checkpoint=False)
        for checkpoint in (False, True):
            got = run(enc, dec, batch, checkpoint)
            errs = [_rel(a, b) for a, b in zip(got, ref, strict=True)]
            assert max(errs) <= FP32_TOL, (shape, checkpoint, errs)
        if i == 0:  # dropout is on: the output is not the dropout-free one
            assert _rel(ref[1], no_dropout[1]) > 1e-2


# --------------------------------------------------------------------------------------------
# Inside DeepSpeed's pipeline engine: 1 stage, activation checkpointing on every layer
# --------------------------------------------------------------------------------------------

ENGINE_UPDATES = ((4, 6), (3, 5), (7, 2))
"""Sentences of the two micro-batches of each update (every micro-batch a new (B, S, T))."""


def _engine_run(compile: bool) -> dict:
    """3 updates of a 2L-2L tiny_cpu stage (dropout 0, lr 1e-3, recompute on every layer)."""
    import deepspeed

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.data.synthetic import SyntheticData, collate
    from megatron_branchnorm.parallel.partition import partition_plan
    from megatron_branchnorm.parallel.pipeline import (
        PipeLoss,
        build_pipeline_module,
        install_engine_fixes,
    )
    from megatron_branchnorm.training.grad_norm import SkipNonfiniteAdamW

    cfg = load_config(
        "tiny_cpu",
        [
            "model.dropout=0.0",
            "model.encoder_layers=2",
            "model.decoder_layers=2",
            "model.branchnorm_steps=8",
            f"model.compile={str(compile).lower()}",
            "pipeline.activation_checkpoint_interval=1",
        ],
    )
    loss_fn = PipeLoss(0.1)
    parts = partition_plan(cfg.model, 1, "balanced")
    module = build_pipeline_module(cfg.model, parts, 7, loss_fn, 1)
    grads: list[dict[str, torch.Tensor]] = []
    names = {id(p): n for n, p in module.named_parameters()}

    class Recording(SkipNonfiniteAdamW):
        """The trainer's optimizer keeping each update's gradients."""

        def step(self, closure=None):
            grads.append(
                {names[id(p)]: p.grad.clone() for g in self.param_groups for p in g["params"]}
            )
            return super().step(closure)

    opt = Recording(module.parameters(), lr=1e-3)
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 2,
        "gradient_clipping": 0.0,
        "steps_per_print": 10**9,
    }
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=opt, config=ds)
    install_engine_fixes(engine)
    data = SyntheticData(200, cfg.model.vocab_size, 20)
    out = {"loss": [], "graphs": [], "graphs_before": _graphs(), "grads": grads}
    start = 0
    for update, sizes in enumerate(ENGINE_UPDATES, start=1):
        set_branch_scale(module, cfg.model, update + 1)  # a new alpha_t every update
        items = []
        for n in sizes:
            b = collate(data, list(range(start, start + n)))
            start += n
            items.append(((b["src_tokens"], b["prev_output_tokens"]), b["target"]))
        loss_fn.scale = 1.0 / 64
        out["loss"].append(float(engine.train_batch(data_iter=iter(items))))
        out["graphs"].append(_graphs())
    return out


@pytest.fixture(scope="module")
def engine_runs():
    with one_rank_process_group():
        torch._dynamo.reset()  # compile here, not reuse the layer tests' graphs
        yield {"eager": _engine_run(False), "compiled": _engine_run(True)}


@pytest.mark.slow
def test_pipeline_engine_with_recompute_matches_eager(engine_runs):
    eager, compiled = engine_runs["eager"], engine_runs["compiled"]
    print("eager loss", eager["loss"], "compiled", compiled["loss"], f"({BACKEND})")
    for a, b in zip(compiled["loss"], eager["loss"], strict=True):
        assert abs(a - b) <= FP32_TOL * abs(b), (compiled["loss"], eager["loss"])
    assert len(compiled["grads"]) == len(eager["grads"]) == len(ENGINE_UPDATES)
    worst = 0.0
    for update, (ours, ref) in enumerate(zip(compiled["grads"], eager["grads"], strict=True)):
        assert ours.keys() == ref.keys()
        for name, g in ref.items():
            err = _rel(ours[name], g)
            worst = max(worst, err)
            assert err <= FP32_TOL, (update, name, err)
    print(f"worst relative gradient error over {len(ENGINE_UPDATES)} updates: {worst:.2e}")
    # (not the parameters: Adam turns a gradient that is rounding noise, as the key bias's
    # (softmax ignores it), into a full lr-sized step either way; its loss and gradients show)
    # the layers did run compiled, and no update after the first compiled a graph
    graphs = compiled["graphs"]
    assert graphs[0] >= compiled["graphs_before"] + 2  # the encoder's and decoder's, at least
    assert graphs[1:] == graphs[:1] * (len(graphs) - 1)
