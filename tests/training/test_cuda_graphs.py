"""``model.cuda_graphs`` (training/cuda_graphs.py; docs/design.md §19) on a CPU.

No capture can run here. What can: the switch's validation; the one-line reasons a stage runs
eagerly; the bookkeeping of :class:`GraphedRange` with a stand-in graph factory (the wrapped
layers run directly): a key is captured once after its warm-up and replayed afterwards, a new
shape captures its own graph, a second micro-batch in flight takes a graph of its own in a
memory pool of its own, the graph budget, validation eager; the same losses and gradients as
the eager layers, bit for bit, with the ids and the encoder output passed through as the very
tensors that came in; and the region a graph captures (:class:`LayerRun`, forward and backward)
passes the capture audit. The graphed run against the eager one on a GPU is the GPU check's
row (workflows/gpu_check.py).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable

import pytest
import torch
from torch import nn

from megatron_branchnorm.config import ConfigError, load_config
from megatron_branchnorm.experiments.capture_audit import audited, replay_difference
from megatron_branchnorm.model.residual import set_branch_scale, stack_constants
from megatron_branchnorm.parallel.pipeline import (
    DecoderLayerPipe,
    EncoderLayerPipe,
    FinalNormPipe,
    StageBias,
)
from megatron_branchnorm.tokens import PAD_ID
from megatron_branchnorm.training import cuda_graphs
from megatron_branchnorm.training.cuda_graphs import LayerRun, eager_reason, install
from megatron_branchnorm.training.graph_capture import (
    CapturedChain,
    CapturedRange,
    Links,
    capture_factory,
)
from tests.core.helpers import random_tokens, tiny_config
from tests.training import graph_double
from tests.training.graph_engine import engine_run


def test_the_graph_double_lets_a_replay_overwrite_what_later_captures_of_its_pool_made() -> None:
    """The double's pools (tests/training/graph_double.py): replaying a graph fills with NaN
    the floating tensors a later capture of its pool allocated, as a GPU may overwrite them;
    not its own, not an earlier capture's, not another pool's, not a buffer made outside any
    capture."""
    x = torch.ones(3)
    outside = torch.empty(3)  # allocated outside any capture: not the pool's

    def capture(pool) -> tuple[graph_double.CUDAGraph, torch.Tensor]:
        g = graph_double.CUDAGraph()
        with graph_double.graph(g, pool=pool):
            out = x * 2
            outside.copy_(out)
        return g, out

    shared, other = graph_double.graph_pool_handle(), graph_double.graph_pool_handle()
    first, first_out = capture(shared)
    second, second_out = capture(shared)
    apart, apart_out = capture(other)
    second.replay()
    apart.replay()
    first.replay()
    assert torch.equal(first_out, x * 2) and torch.equal(apart_out, x * 2)
    assert torch.equal(outside, x * 2)
    assert second_out.isnan().all()  # the later capture of the replayed graph's pool
    second.replay()
    assert torch.equal(second_out, x * 2) and torch.equal(first_out, x * 2)


def test_the_graph_double_refuses_a_replay_over_a_tensor_given_other_memory() -> None:
    """A GPU graph reads the addresses it captured: a weight given new memory after the capture
    (``p.data = ...``) would be read stale there, so the double's replay refuses it; an
    in-place update (an optimizer step) replays with the new values."""
    weight = nn.Parameter(torch.ones(3))
    x = torch.ones(3)
    g = graph_double.CUDAGraph()
    with graph_double.graph(g, pool=graph_double.graph_pool_handle()):
        out = weight * x
    with torch.no_grad():
        weight.add_(1.0)
    g.replay()
    assert torch.equal(out, torch.full((3,), 2.0))
    weight.data = torch.full((3,), 5.0)
    with pytest.raises(AssertionError, match="moved since the capture"):
        g.replay()


def test_the_planners_graph_set_is_what_a_built_stage_keeps() -> None:
    """planner.StagePlan's graph set and shared gradient bytes (what ``tools/plan_memory.py``
    and the trainer's allowance count) equal static_bytes and grad_buffer_bytes over the
    ranges of a built one-stage model, whole and cut into links."""
    from megatron_branchnorm.parallel.planner import plan_run

    rows, length = 4, 6  # both sides: a micro-batch of 24 tokens
    cfg = load_config("tiny_cpu", ["model.residual=preln"])  # final norms with parameters
    plan = plan_run(cfg, 1, 80e9, micro_batch_tokens=rows * length)
    assert plan.precision.name == "fp32" and plan.stage_plans[0].layer_ranges == 2
    m = dataclasses.replace(cfg.model, vocab_size=plan.model.vocab_size)
    stage = _stage(m)
    enc = stage.forward_funcs[1 : 2 + m.encoder_layers]
    dec = stage.forward_funcs[3 + m.encoder_layers : -1]
    h = torch.randn(rows, length, m.hidden_size, requires_grad=True)
    ids = random_tokens(rows, length)
    built = cuda_graphs.static_bytes((h, ids, ids)) + cuda_graphs.static_bytes((h, h, ids))
    assert any(p.numel() for f in (enc[-1], dec[-1]) for p in f.parameters())
    grads = cuda_graphs.grad_buffer_bytes(enc) + cuda_graphs.grad_buffer_bytes(dec)
    assert plan.stage_plans[0].graph_grad_bytes == grads
    assert plan.stage_plans[0].graph_set_bytes == built
    for link_layers in (1, 2, 4, 5):  # cut into links (design §19, "Links"), as install cuts
        links = [len(cuda_graphs.link_parts(r, link_layers)) for r in (enc, dec)]
        built = cuda_graphs.static_bytes((h, ids, ids), links[0])
        built += cuda_graphs.static_bytes((h, h, ids), links[1])
        assert plan.set_bytes(plan.stage_plans[0], link_layers) == built, link_layers


CUDA = torch.device("cuda")  # only named: nothing here runs on it
ELIGIBLE = {
    "device": CUDA,
    "bucket_shapes": "auto",
    "checkpoint_interval": 0,
    "compiled": False,
    "grads_handed_over": True,
}
"""A stage that can be graphed."""


def test_the_switch_takes_off_on_auto_and_refuses_the_rest() -> None:
    assert load_config("tiny_cpu").model.cuda_graphs == "off"
    for mode in ("off", "on", "auto"):
        assert load_config("tiny_cpu", [f"model.cuda_graphs={mode}"]).model.cuda_graphs == mode
    for bad in ("yes", "true", "On"):
        with pytest.raises(ConfigError, match=r"model\.cuda_graphs: unknown mode") as exc:
            load_config("tiny_cpu", [f"model.cuda_graphs={bad}"])
        assert "\n" not in str(exc.value) and "off, on, auto" in str(exc.value)


def _reason(**kw) -> str | None:
    settings = {k: v for k, v in {**ELIGIBLE, **kw}.items() if k != "checkpoint_interval"}
    return eager_reason(**settings)


def test_the_link_length_takes_auto_or_a_count_and_refuses_the_rest() -> None:
    """model.cuda_graph_link_layers (design §19, "Links"): auto by default, a count of layers
    taken as set by the planner (0 and a count past the longest range: whole ranges)."""
    from megatron_branchnorm.parallel.planner import plan_run

    assert load_config("tiny_cpu").model.cuda_graph_link_layers == "auto"
    for bad in ("-1", "two", "1.5"):
        with pytest.raises(ConfigError, match=r"model\.cuda_graph_link_layers") as exc:
            load_config("tiny_cpu", [f"model.cuda_graph_link_layers={bad}"])
        assert "\n" not in str(exc.value)
    over = ["pipeline.activation_checkpoint_interval=1"]
    for links, want in (("0", 0), ("2", 2), ("5", 5), ("6", 0), ("99", 0)):  # 6 + 6 layers
        cfg = load_config("tiny_cpu", [*over, f"model.cuda_graph_link_layers={links}"])
        plan = plan_run(cfg, 1, 1e12).with_shapes(4, True)
        stage = plan.stage_plans[0]
        assert plan.link_layers(stage) == want, links
        assert plan.graph_sets(stage) == plan._sets(stage, True, want)
    cfg = load_config("tiny_cpu", ["model.cuda_graph_link_layers=2"])  # no recompute: ignored
    plan = plan_run(cfg, 1, 1e12).with_shapes(4, True)
    assert plan.link_layers(plan.stage_plans[0]) == 0


def test_each_reason_to_run_eagerly_is_one_line() -> None:
    assert _reason() is None
    cases = {
        "no CUDA device": {"device": torch.device("cpu")},
        "data.bucket_shapes=0": {"bucket_shapes": 0},
        "model.compile=true": {"compiled": True},
        "torch_autocast in the DeepSpeed JSON": {"autocast": True},
        "parameter gradients stay in .grad": {"grads_handed_over": False},
    }
    for needle, kw in cases.items():
        line = _reason(**kw)
        assert line is not None and needle in line and "\n" not in line, (needle, line)


def _stage(cfg) -> types.SimpleNamespace:
    """A stage's forward_funcs as DeepSpeed holds them: embedding, encoder layers, final norm,
    decoder embedding, decoder layers, final norm, output (the non-layer entries plain
    functions)."""
    (a_enc, b_enc), (a_dec, b_dec) = stack_constants(cfg)
    enc = [EncoderLayerPipe(cfg, a_enc, b_enc, 1, i) for i in range(cfg.encoder_layers)]
    dec = [DecoderLayerPipe(cfg, a_dec, b_dec, 1, i) for i in range(cfg.decoder_layers)]

    def embed(inputs):
        return inputs

    def dec_embed(inputs):
        return inputs

    funcs = [embed, *enc, FinalNormPipe(cfg), dec_embed, *dec, FinalNormPipe(cfg), embed]
    stage = types.SimpleNamespace(forward_funcs=funcs, layers=nn.ModuleList(enc + dec))
    stage.forward = lambda batch: _forward(stage.forward_funcs, batch)  # as PipelineModule's
    stage.activation_checkpoint_interval, stage.checkpointed = 0, []

    def checkpoint(function, *args):
        stage.checkpointed.append(tuple(tuple(a.shape) for a in args))
        return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)

    def set_checkpoint_interval(interval: int) -> None:
        stage.activation_checkpoint_interval = interval

    stage.activation_checkpoint_func = checkpoint
    stage.set_checkpoint_interval = set_checkpoint_interval
    return stage


class FakeFactory:
    """Stands in for the capture (graph_capture.py): records each capture and returns the wrapper
    module itself (its layers run directly)."""

    def __init__(self) -> None:
        self.captures: list[tuple] = []
        self.replays = 0

    def __call__(self, module: nn.Module, sample: tuple, pool):
        assert isinstance(module, LayerRun)
        assert all(not s.requires_grad or s.is_leaf for s in sample)  # clones, not the inputs
        self.captures.append((tuple(tuple(s.shape) for s in sample), pool))

        def graphed(*args):
            self.replays += 1
            return module(*args)

        return graphed


def _install(stage, factory=None, max_graphs=cuda_graphs.MAX_GRAPHS, memory=float("inf"), **kw):
    lines: list[str] = []
    pools = iter(range(100))
    new_pool = graph_double.graph_pool_handle  # pools as the double models them
    if factory is None and "cuda" not in kw:
        factory = FakeFactory()  # else the trainer's own factory, capturing on kw["cuda"]
    if isinstance(factory, FakeFactory):
        new_pool = lambda: next(pools)  # noqa: E731
    ranges = install(
        stage, "on", **{**ELIGIBLE, **kw}, log=lines.append, factory=factory,
        new_pool=new_pool, max_graphs=max_graphs, memory=memory,
    )  # fmt: skip
    return ranges, lines


def test_on_a_cpu_the_stage_is_left_exactly_as_built() -> None:
    stage = _stage(tiny_config())
    before = list(stage.forward_funcs)
    lines: list[str] = []
    cpu = {**ELIGIBLE, "device": torch.device("cpu")}
    for mode, said in (("off", 0), ("auto", 0), ("on", 1)):
        lines.clear()
        assert install(stage, mode, log=lines.append, **cpu) == []
        assert len(lines) == said, (mode, lines)
        assert all(a is b for a, b in zip(stage.forward_funcs, before, strict=True))
        assert not hasattr(stage, "graphed_funcs")  # its forward is its own
    assert "model.cuda_graphs=on: layers run eagerly: no CUDA device" in lines[0]
    for kw in (
        {"bucket_shapes": 0},
        {"compiled": True},
        {"grads_handed_over": False},
    ):
        ranges, said = _install(stage, **kw)
        assert ranges == [] and len(said) == 1, said
        assert all(a is b for a, b in zip(stage.forward_funcs, before, strict=True))


def _batch(cfg, rows: int, s: int, t: int, seed: int) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    src, prev = random_tokens(rows, s, seed), random_tokens(rows, t, seed + 1)
    src[0, s // 2 :] = PAD_ID
    x_enc = torch.randn(rows, s, cfg.hidden_size, generator=gen).requires_grad_()
    x_dec = torch.randn(rows, t, cfg.hidden_size, generator=gen).requires_grad_()
    return x_enc, x_dec, src, prev


def _forward(funcs, batch) -> tuple[torch.Tensor, tuple]:
    """The stage's entries as DeepSpeed runs them, with the decoder embedding's input made
    of the encoder's output (as decoder_embed_fn does); returns the output and the encoder
    run's result."""
    x_enc, x_dec, src, prev = batch
    h = (x_enc, src, prev)
    enc_out = None
    for f in funcs:
        if f.__class__.__name__ == "function" and f.__name__ == "dec_embed":
            enc_out = h
            h = (x_dec, h[0], src)
        h = f(h)
    return h, enc_out


def _loss_and_grads(stage, funcs, batch):
    for p in stage.layers.parameters():
        p.grad = None
    out, enc_out = funcs(batch) if callable(funcs) else _forward(funcs, batch)
    loss = (out.float() ** 2).mean()
    loss.backward()
    grads = [p.grad.clone() for p in stage.layers.parameters()]
    return loss.detach(), grads, enc_out, [batch[0].grad.clone(), batch[1].grad.clone()]


def test_capture_once_per_shape_after_warmup_then_replay_bit_identical() -> None:
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10)
    torch.manual_seed(0)
    stage = _stage(cfg)
    eager_funcs = list(stage.forward_funcs)
    factory = FakeFactory()
    ranges, lines = _install(stage, factory)
    assert len(ranges) == 2 and len(stage.graphed_funcs) == len(eager_funcs) - (
        cfg.encoder_layers + cfg.decoder_layers
    )
    assert all(a is b for a, b in zip(stage.forward_funcs, eager_funcs, strict=True))
    assert len(lines) == 1 and "2 layer range(s) captured per bucket shape" in lines[0]
    shapes = [(2, 8, 6)] * (cuda_graphs.WARMUP + 3) + [(3, 5, 4)] * (cuda_graphs.WARMUP + 1)
    for i, shape in enumerate(shapes):
        set_branch_scale(stage.layers, cfg, i + 1)
        batch = _batch(cfg, *shape, seed=i)
        want = _loss_and_grads(stage, eager_funcs, batch)
        for t in batch[:2]:
            t.grad = None
        got = _loss_and_grads(stage, stage.forward, batch)
        assert torch.equal(got[0], want[0])
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got[3], want[3], strict=True))
        assert got[2][1] is batch[2] and got[2][2] is batch[3]  # ids passed through as given
    # 2 ranges x 2 shapes captured once each, after WARMUP eager calls of that shape
    assert len(factory.captures) == 4, factory.captures
    assert factory.replays == 2 * (3 + 1)
    assert [r.captures for r in ranges] == [2, 2]
    assert {pool for _, pool in factory.captures} == {0, 1}  # one pool per range, slot 0
    assert sum("first graph captured" in line for line in lines) == 2, lines  # one per range


def test_a_second_micro_batch_in_flight_takes_its_own_graph_and_pool() -> None:
    cfg = tiny_config()
    torch.manual_seed(0)
    stage = _stage(cfg)
    factory = FakeFactory()
    (enc, dec), _ = _install(stage, factory)
    for i in range(cuda_graphs.WARMUP):
        _loss_and_grads(stage, stage.forward, _batch(cfg, 2, 8, 6, i))
    outs = [stage.forward(_batch(cfg, 2, 8, 6, 10 + i))[0] for i in range(2)]
    assert [len(k.slots) for k in enc.keys.values()] == [2]  # two forwards before a backward
    assert sorted(enc.pools) == [0, 1] and enc.pools[0] != enc.pools[1]
    for out in outs:
        out.float().pow(2).mean().backward()
    assert not any(g.busy for k in enc.keys.values() for g in k.slots.values())
    _loss_and_grads(stage, stage.forward, _batch(cfg, 2, 8, 6, 20))
    assert len(factory.captures) == 4  # slot 0 replayed again, nothing new captured
    with torch.no_grad():  # validation: eager, no capture, nothing in flight
        stage.forward(_batch(cfg, 2, 8, 6, 30))
    assert len(factory.captures) == 4 and dec.replays == 3


def test_past_the_graph_budget_a_shape_runs_eagerly_said_once() -> None:
    cfg = tiny_config()
    torch.manual_seed(0)
    stage = _stage(cfg)
    factory = FakeFactory()
    _, lines = _install(stage, factory, max_graphs=2)
    for shape in [(2, 8, 6)] * (cuda_graphs.WARMUP + 1) + [(3, 5, 4)] * (cuda_graphs.WARMUP + 2):
        _loss_and_grads(stage, stage.forward, _batch(cfg, *shape, 0))
    assert len(factory.captures) == 2
    spent = [line for line in lines if "graph budget is spent" in line]
    assert len(spent) == 2 and all("(3, 5, 32)" in line for line in spent), lines  # per range


def test_a_capture_the_device_refuses_is_one_line_naming_the_way_out() -> None:
    """A capture that raises (CUDA refuses an operation while a stream captures) ends the run
    with one line naming the range, the shapes, torch's words and model.cuda_graphs=off (a
    TrainError: exit 2 through trainer.run); out of memory stays the trainer's own error."""
    from megatron_branchnorm.errors import UserError

    cfg = tiny_config()
    for raised, caught in (
        (RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore"),
         cuda_graphs.GraphCaptureError),
        (torch.OutOfMemoryError("CUDA out of memory."), torch.OutOfMemoryError),
    ):  # fmt: skip
        torch.manual_seed(0)
        stage = _stage(cfg)

        def refuse(module, sample, pool, error=raised):
            raise error

        ranges, lines = _install(stage, refuse)
        batch = _batch(cfg, 2, 8, 6, 0)
        for _ in range(cuda_graphs.WARMUP):  # eager: no capture yet
            _loss_and_grads(stage, stage.forward, batch)
        with pytest.raises(caught) as info:
            stage.forward(batch)
        assert cuda_graphs.memory_note(ranges) == ""  # nothing captured holds memory
        if caught is torch.OutOfMemoryError:  # the log says where, the trainer's line what
            assert lines[-1] == (
                "cuda graphs: layers 1-3 of the stage: capturing inputs of shapes (2, 8, 32), "
                "(2, 8), (2, 6) ran out of memory"
            )
        if caught is cuda_graphs.GraphCaptureError:
            text = str(info.value)
            assert isinstance(info.value, UserError) and "\n" not in text
            assert text.startswith("cuda graphs: layers 1-3 of the stage: the device refused")
            assert "inputs of shapes (2, 8, 32)" in text
            assert "operation not permitted when stream is capturing more" in text
            assert text.endswith("train with model.cuda_graphs=off")


@pytest.mark.parametrize(
    ("recompute", "link_layers", "shorter"),
    [(False, 0, ""), (True, 0, "below 2"), (True, 1, "")],
    ids=["in-flight", "recomputing-whole", "links-of-a-layer"],
)
def test_the_out_of_memory_line_names_the_captured_graphs_and_how_to_free_them(
    recompute, link_layers, shorter
) -> None:
    """cuda_graphs.memory_note, which the trainer's out-of-memory line carries: the graphs a
    stage captured and the keys that give their memory back (shorter links where the stage
    recomputes and its links are longer than a layer; the graphs off always)."""
    cfg = tiny_config()
    torch.manual_seed(0)
    stage = _stage(cfg)
    kw = {"checkpoint_interval": 1, "link_layers": link_layers} if recompute else {}
    ranges, _ = _install(stage, cuda=graph_double, **kw)  # the trainer's capture
    batch = _batch(cfg, 2, 8, 6, 0)
    for _ in range(cuda_graphs.WARMUP + 1):
        _loss_and_grads(stage, stage.forward, batch)
    note = cuda_graphs.memory_note(ranges)
    assert note.startswith(", with 2 CUDA graph(s) captured") and "\n" not in note
    links = f"shorter links (model.cuda_graph_link_layers {shorter}: a smaller pool) or "
    assert note.endswith("resume with " + (links if shorter else "") + "model.cuda_graphs=off")
    assert ("in links (2 at most)" in note) == bool(link_layers)


def test_past_the_memory_allowance_a_range_runs_eagerly_said_once() -> None:
    cfg = tiny_config()
    torch.manual_seed(0)
    stage = _stage(cfg)
    enc_layers = stage.forward_funcs[1 : 2 + cfg.encoder_layers]
    x_enc, _, src, prev = _batch(cfg, 2, 8, 6, 0)
    enc_bytes = cuda_graphs.static_bytes((x_enc, src, prev)) + cuda_graphs.grad_buffer_bytes(
        enc_layers
    )
    factory = FakeFactory()
    _, lines = _install(stage, factory, memory=enc_bytes)  # the encoder range's graph only
    assert "keeping 0.00 GiB of static buffers" in lines[0], lines
    for seed in range(cuda_graphs.WARMUP + 2):
        _loss_and_grads(stage, stage.forward, _batch(cfg, 2, 8, 6, seed))
    assert len(factory.captures) == 1 and factory.captures[0][0][0] == (2, 8, cfg.hidden_size)
    spent = [line for line in lines if "graph budget is spent (memory" in line]
    assert len(spent) == 1 and "layers " in spent[0] and "GiB of the planner" in spent[0], lines


def test_static_bytes_are_what_a_graph_keeps_between_replays() -> None:
    """static_bytes against the static tensors a capture keeps, and grad_buffer_bytes against
    the stage's shared gradient buffers, which a second graph of the range reuses."""
    cfg = tiny_config()
    torch.manual_seed(0)
    stage = _stage(cfg)
    dec_layers = stage.forward_funcs[3 + cfg.encoder_layers : -1]
    buffers: dict = {}
    captured = []
    for rows in (3, 2):
        x_dec, memory = torch.randn(rows, 5, cfg.hidden_size), torch.randn(rows, 7, cfg.hidden_size)
        args = (x_dec.requires_grad_(), memory.requires_grad_(), random_tokens(rows, 7))
        sample = tuple(a.detach().clone().requires_grad_(a.requires_grad) for a in args)
        run = LayerRun(dec_layers, as_tuple=True)
        c = CapturedRange(run, sample, None, buffers, cuda=graph_double)
        grads_in = [g for g in c.input_grads if g is not None]
        kept = [*c.static_in, c.static_out, c.static_grad_out, *grads_in]
        assert len({t.data_ptr() for t in kept}) == len(kept)  # distinct, none counted twice
        assert cuda_graphs.static_bytes(args) == sum(t.nbytes for t in kept)
        captured.append(c)
    assert all(a is b for a, b in zip(*(c.param_grads for c in captured), strict=True))
    assert sum(b.nbytes for b in buffers.values()) == cuda_graphs.grad_buffer_bytes(dec_layers)
    # cut into a link a layer (design §19, "Links"): the first link's inputs and output
    # gradient serve every link; each further link adds its output and input gradients
    parts = cuda_graphs.link_parts(dec_layers, 1)
    assert [len(p) for p in parts] == [1, 2]  # the final norm stays with the last layer
    chain = CapturedChain(
        Links([LayerRun(p, as_tuple=True) for p in parts]), sample, None, buffers, graph_double
    )
    kept = [*chain.static_in, chain.links[0].static_grad_out]
    for link in chain.links:
        assert link.static_grad_out is chain.links[0].static_grad_out
        kept += [link.static_out, *(g for g in link.input_grads if g is not None)]
    assert len({t.data_ptr() for t in kept}) == len(kept)
    assert cuda_graphs.static_bytes(args, len(parts)) == sum(t.nbytes for t in kept)
    assert cuda_graphs.static_bytes(args, 2) - cuda_graphs.static_bytes(args) == (
        2 * x_dec.nbytes + memory.nbytes
    )


def test_links_are_cut_evenly_and_keep_a_final_norm_with_its_layer() -> None:
    cfg = tiny_config(encoder_layers=7)
    funcs = _stage(cfg).forward_funcs[1 : 2 + cfg.encoder_layers]  # 7 layers and their norm
    for layers_per_link, sizes in ((0, [7]), (3, [3, 2, 2]), (4, [4, 3]), (7, [7]), (9, [7])):
        parts = cuda_graphs.link_parts(funcs, layers_per_link)
        layers = [sum(isinstance(f, EncoderLayerPipe) for f in p) for p in parts]
        assert layers == sizes and [f for p in parts for f in p] == funcs, layers_per_link
        assert isinstance(parts[-1][-1], FinalNormPipe)
        assert all(isinstance(p[0], EncoderLayerPipe) for p in parts)


def test_the_capture_replays_as_the_eager_layers_compute_bit_for_bit() -> None:
    """The trainer's capture (graph_capture.py) on the graph double, which replays recorded
    operators on the captured tensors as a GPU replays kernels: new data, new alpha_t and new
    weights each micro-batch give the eager losses, input and parameter gradients bit for bit,
    and each parameter's gradient reaches ``.grad`` through the stage's shared buffer."""
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10)
    torch.manual_seed(0)
    stage = _stage(cfg)
    eager_funcs = list(stage.forward_funcs)
    buffers: dict = {}
    ranges, _ = _install(stage, capture_factory(buffers, cuda=graph_double))
    for i in range(cuda_graphs.WARMUP + 4):
        set_branch_scale(stage.layers, cfg, i + 1)
        with torch.no_grad():
            for p in stage.layers.parameters():  # as an optimizer step would, in place
                p.add_(torch.randn_like(p), alpha=1e-3)
        batch = _batch(cfg, 2, 8, 6, seed=i)
        want = _loss_and_grads(stage, eager_funcs, batch)
        for t in batch[:2]:
            t.grad = None
        got = _loss_and_grads(stage, stage.forward, batch)
        assert torch.equal(got[0], want[0]), i
        assert all(torch.equal(a, b) for a, b in zip(got[1], want[1], strict=True)), i
        assert all(torch.equal(a, b) for a, b in zip(got[3], want[3], strict=True)), i
    assert [r.replays for r in ranges] == [4, 4] and [r.captures for r in ranges] == [1, 1]
    shared = {b.data_ptr() for b in buffers.values()}
    assert len(buffers) == len(list(stage.layers.parameters()))
    assert {p.grad.data_ptr() for p in stage.layers.parameters()} <= shared  # taken, not copied


@pytest.mark.parametrize("link_layers", [0, 1], ids=["whole", "links"])
def test_the_captured_region_passes_the_capture_audit(link_layers) -> None:
    """What a graph captures, a range's layers or each of its links (design §19, "Links"):
    no host sync, no finding of the audit, the same calls for two batches of one shape."""
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10, dropout=0.1)
    torch.manual_seed(0)
    stage = _stage(cfg)
    enc = stage.forward_funcs[1 : 1 + cfg.encoder_layers + 1]
    dec = stage.forward_funcs[3 + cfg.encoder_layers : -1]

    def region(layers: list) -> nn.Module:
        parts = cuda_graphs.link_parts(layers, link_layers)
        return Links([LayerRun(p, as_tuple=True) for p in parts]) if link_layers else (
            LayerRun(layers, as_tuple=True))  # fmt: skip

    enc_run, dec_run = region(enc), region(dec)
    audits = []
    for seed, step in ((1, 3), (2, 7)):
        x_enc, x_dec, src, prev = _batch(cfg, 3, 7, 6, seed)
        set_branch_scale(stage.layers, cfg, step)
        stage.layers.zero_grad(set_to_none=True)
        grad = torch.randn(3, 6, cfg.hidden_size)
        # the padding-bias cache cold for the first batch, warm with these very ids for the
        # second (as a capture's warm-up leaves it): the region computes the bias
        # itself either way, so a capture never reads a bias made outside the graph
        StageBias.clear() if seed == 1 else StageBias.get(src, x_enc.dtype)
        with audited() as audit:
            memory = enc_run(x_enc, src, prev)
            dec_run(x_dec, memory, src).backward(grad)
        audits.append(audit)
    for audit in audits:
        assert audit.findings == [] and audit.host_syncs == 0, [f.line() for f in audit.findings]
    assert replay_difference(*audits) is None
    assert len(audits[0].calls) > 50


def on_the_double(*_args) -> Callable:
    """The trainer's capture (training/graph_capture.py) on the CPU graph double: a fresh
    stage's factory, its graphs sharing one set of gradient buffers."""
    return capture_factory({}, cuda=graph_double)


@pytest.mark.distributed
def test_through_the_engine_graphed_equals_eager_and_the_grad_trap_is_refused() -> None:
    from tests.core.helpers import one_rank_process_group

    with one_rank_process_group():
        eager = engine_run("bf16", graphs=False)
        graphed = engine_run("bf16", graphs=True)
        assert [r.replays for r in graphed["ranges"]] == [4, 4]  # 6 micro-batches, 2 warm-up
        assert graphed["loss"] == eager["loss"] and graphed["norm"] == eager["norm"]
        # fp32: .grad keeps gradients across micro-batches, so the trainer's condition says
        # no and install refuses (test_on_a_cpu_the_stage_is_left_exactly_as_built)...
        ref = engine_run("fp32", graphs=False)
        assert ref["handed"] is False and eager["handed"] is True
        # ...because graphing it anyway adds the last replay's gradient twice
        forced = engine_run("fp32", graphs=True, handed_over=True)
        assert forced["loss"] == ref["loss"]
        assert not torch.equal(forced["grads"][-1], ref["grads"][-1])


@pytest.mark.distributed
def test_a_graphed_stage_saves_and_loads_every_layer_as_an_eager_one(tmp_path) -> None:
    """DeepSpeed saves and loads a stage entry by entry from ``forward_funcs``, skipping entries
    without ``state_dict``: with the ranges in that list a checkpoint held no layer, and a resume
    trained fresh weights without a word. The list stays as built; the graphed forward reads
    the loaded weights."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    from megatron_branchnorm.parallel.partition import partition_plan
    from megatron_branchnorm.parallel.pipeline import PipeLoss, build_pipeline_module
    from tests.core.helpers import one_rank_process_group

    cfg = tiny_config(residual="preln")
    engine = TorchCheckpointEngine()

    def built(seed: int):
        module = build_pipeline_module(cfg, partition_plan(cfg, 1, "balanced"), seed, PipeLoss(0))
        module.checkpoint_parallel_write_pipeline = False
        return module

    with one_rank_process_group():
        eager, graphed = built(1), built(2)
        ranges, _ = _install(graphed, FakeFactory())
        assert len(ranges) == 2
        eager.save_state_dict(str(tmp_path / "eager"), engine)
        graphed.save_state_dict(str(tmp_path / "graphed"), engine)
        names = [sorted(p.name for p in (tmp_path / d).iterdir()) for d in ("eager", "graphed")]
        assert names[0] == names[1] and len(names[0]) == len(eager.forward_funcs) - 2, names
        graphed.load_state_dir(str(tmp_path / "eager"), engine)
        want, got = eager.state_dict(), graphed.state_dict()
        assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
        ids = random_tokens(2, 5)
        for module in (eager, graphed):
            module.train()
        with torch.enable_grad():
            outs = [m((ids, ids)).detach() for m in (eager, graphed)]
        assert torch.equal(*outs) and ranges[0].keys  # the graphed forward ran, same weights


def _handed_over_backward(stage, out: torch.Tensor) -> list[torch.Tensor]:
    """One micro-batch's backward, as DeepSpeed runs it (a backward call of its own), with the
    parameter gradients taken out of ``.grad`` right after, as the bf16 hand-over does."""
    for p in stage.layers.parameters():
        p.grad = None
    out.float().pow(2).mean().backward()
    return [p.grad.clone() for p in stage.layers.parameters()]


@pytest.mark.parametrize(
    "depth,link_layers,links", [(2, 0, 1), (3, 1, 3), (3, 2, 2)], ids=["whole", "1", "2"]
)
def test_a_recomputing_stage_keeps_one_graph_per_shape_and_computes_as_eager(
    depth, link_layers, links
) -> None:
    """On a stage that checkpoints, the ranges recompute themselves: two micro-batches in flight
    share one graph per range, DeepSpeed's checkpointing of the stage is off, the warm-up calls
    go through the stage's checkpoint function chunk by chunk, and with dropout every replayed
    micro-batch's loss and gradients equal the eager layers' from the same random state (the
    recompute draws the forward's masks). Cut into links (``link_layers``; design §19,
    "Links"), each link's backward recomputes it from its own kept input and random state:
    bit for bit as eager with a layer a link; with longer links the encoder output's gradient
    is summed per link before across them (a float rounding apart)."""
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10, dropout=0.1,
                      encoder_layers=depth, decoder_layers=depth)  # fmt: skip
    torch.manual_seed(0)
    stage = _stage(cfg)
    eager_funcs = list(stage.forward_funcs)
    stage.set_checkpoint_interval(1)
    ranges, lines = _install(stage, checkpoint_interval=1, cuda=graph_double,
                             link_layers=link_layers)  # fmt: skip
    assert stage.activation_checkpoint_interval == 0 and "recomputed in the backward" in lines[0]
    assert [len(r.links) for r in ranges] == [links, links]
    same = torch.equal if link_layers < 2 else _close
    for i in range(cuda_graphs.WARMUP):  # eager, through checkpoint, one layer a chunk
        _loss_and_grads(stage, stage.forward, _batch(cfg, 2, 8, 6, i))
    layers = cfg.encoder_layers + cfg.decoder_layers
    assert len(stage.checkpointed) == cuda_graphs.WARMUP * layers
    compared = 0
    for i in range(4):
        set_branch_scale(stage.layers, cfg, i + 1)
        batches = [_batch(cfg, 2, 8, 6, 10 + 2 * i + j) for j in range(2)]
        states, outs, captures = [], [], sum(r.captures for r in ranges)
        for batch in batches:  # two forwards in flight, then their backwards
            states.append(torch.get_rng_state())
            outs.append(stage.forward(batch)[0])
        got = [_handed_over_backward(stage, out) for out in outs]
        if sum(r.captures for r in ranges) != captures:
            continue  # a capture drew random numbers before the replay: not comparable
        want_outs = []
        for state, batch in zip(states, batches, strict=True):
            torch.set_rng_state(state)
            want_outs.append(_forward(eager_funcs, tuple(t.detach() for t in batch))[0])
        for got_out, want_out in zip(outs, want_outs, strict=True):
            assert torch.equal(got_out, want_out), i
        want = [_handed_over_backward(stage, out) for out in want_outs]
        for a, b in zip(got, want, strict=True):
            assert all(same(x, y) for x, y in zip(a, b, strict=True)), i
        compared += 1
    assert compared >= 3 and [r.captures for r in ranges] == [1, 1]
    (captured,) = (g.fn for r in ranges[:1] for k in r.keys.values() for g in k.slots.values())
    assert captured.warmup_iters == 0  # the trainer's factory: no room for a warm-up copy
    assert len(getattr(captured, "links", [captured])) == links
    assert ranges[0].pools == ranges[1].pools and list(ranges[0].pools) == [0]  # one pool
    assert len(stage.checkpointed) == cuda_graphs.WARMUP * layers  # replays never checkpoint


@pytest.mark.parametrize("recompute", [False, True], ids=["in-flight", "links"])
def test_two_bucket_shapes_sharing_a_pool_compute_as_eager(recompute) -> None:
    """Two bucket shapes in turn through one stage, whose graphs of both shapes share a pool (a
    slot's, or a recomputing stage's one pool, here in links of a layer): each micro-batch past
    the captures gives the eager loss and gradients bit for bit, with dropout, from the same
    random state. On the graph double every replay of a shape's graphs fills with NaN what the
    other shape's later captures allocated in the pool (tests/training/graph_double.py), as a
    GPU may overwrite it: an output read after another shape's replay would show."""
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10, dropout=0.1,
                      encoder_layers=3, decoder_layers=3)  # fmt: skip
    torch.manual_seed(0)
    stage = _stage(cfg)
    eager_funcs = list(stage.forward_funcs)
    kw = {"checkpoint_interval": 1, "link_layers": 1} if recompute else {}
    if recompute:
        stage.set_checkpoint_interval(1)
    ranges, _ = _install(stage, cuda=graph_double, **kw)
    shapes, compared = ((2, 8, 6), (3, 5, 7)), 0
    for i in range(cuda_graphs.WARMUP + 3):
        set_branch_scale(stage.layers, cfg, i + 1)
        for j, (rows, s, t) in enumerate(shapes):
            batch, captures = _batch(cfg, rows, s, t, 10 * i + j), sum(r.captures for r in ranges)
            state = torch.get_rng_state()
            got = _loss_and_grads(stage, stage.forward, batch)
            if sum(r.captures for r in ranges) != captures or i < cuda_graphs.WARMUP:
                continue  # eager, or a capture drew random numbers before the replay
            torch.set_rng_state(state)
            fresh = tuple(t.detach().clone().requires_grad_(t.requires_grad) for t in batch)
            want = _loss_and_grads(stage, eager_funcs, fresh)
            assert torch.equal(got[0], want[0]), (i, j)
            for a, b in ((got[1], want[1]), (got[3], want[3])):
                assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), (i, j)
            compared += 1
    assert [r.captures for r in ranges] == [2, 2] and compared == 4
    pools = {id(p) for r in ranges for p in r.pools.values()}
    assert len(pools) == (1 if recompute else 2)  # the stage's one, or each range's slot 0


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to float rounding, relative to the tensor's size (the encoder's gradients through
    the encoder output are ~1e-10 here)."""
    return bool((a - b).norm() <= 1e-5 * b.norm())


@pytest.mark.parametrize("interval", [0, 1])
def test_a_boundary_stage_under_one_backward_per_output_computes_as_eager(interval) -> None:
    """A stage that ends inside the decoder sends (x_dec, memory, src); DeepSpeed's stock
    backward runs one backward call per float output (the trainer installs one call for all,
    pipeline.install_backward_once), so the encoder range's backward replays twice in one
    micro-batch. Each replay's input gradient must be its own tensor: had the stage input's
    ``.grad`` kept the first replay's static buffer, the second replay would overwrite it and
    count itself twice. Parameter gradients are handed over after each call, as bf16's are."""
    cfg = tiny_config(residual="branchnorm", branchnorm_steps=10)
    torch.manual_seed(0)
    stage = _stage(cfg)
    n = cfg.encoder_layers
    stage.forward_funcs = stage.forward_funcs[: n + 4]  # ..., dec_embed, decoder layer 0
    eager_funcs = list(stage.forward_funcs)
    stage.set_checkpoint_interval(interval)
    ranges, _ = _install(stage, on_the_double(), checkpoint_interval=interval)

    def run(forward, batch, seed: int) -> tuple[list, list]:
        leaves = [t.detach().clone().requires_grad_() for t in batch[:2]]
        out, _ = forward((*(t.clone() for t in leaves), *batch[2:]))  # as the pipe's clones
        floats = [t for t in out if t.is_floating_point()]
        gen = torch.Generator().manual_seed(seed)
        params = [torch.zeros_like(p) for p in stage.layers.parameters()]
        for i, t in enumerate(floats):  # DeepSpeed's stock _exec_backward_pass
            t.backward(torch.randn(t.shape, generator=gen), retain_graph=i < len(floats) - 1)
            for total, p in zip(params, stage.layers.parameters(), strict=True):
                if p.grad is not None:  # the hand-over
                    total += p.grad
                    p.grad = None
        return [t.grad for t in leaves], params

    for i in range(cuda_graphs.WARMUP + 3):
        batch = _batch(cfg, 2, 8, 6, seed=i)
        got = run(stage.forward, batch, i)
        want = run(lambda b: _forward(eager_funcs, b), batch, i)
        for a, b in zip([*got[0], *got[1]], [*want[0], *want[1]], strict=True):
            assert torch.equal(a, b), i
    assert [r.replays for r in ranges] == [3, 3]


@pytest.mark.distributed
def test_through_the_engine_a_recomputing_graphed_stage_equals_eager_checkpointing() -> None:
    from tests.core.helpers import one_rank_process_group

    with one_rank_process_group():
        eager = engine_run("bf16", graphs=False, interval=1)
        graphed = engine_run("bf16", graphs=True, interval=1)
        linked = engine_run("bf16", graphs=True, interval=1, link_layers=1)
    assert eager["interval"] == 1 and graphed["interval"] == 0
    assert [r.replays for r in graphed["ranges"]] == [4, 4]
    assert graphed["loss"] == eager["loss"] and graphed["norm"] == eager["norm"]
    assert [len(r.links) for r in linked["ranges"]] == [2, 2]  # a layer a link
    assert [r.replays for r in linked["ranges"]] == [4, 4]
    assert linked["loss"] == eager["loss"] and linked["norm"] == eager["norm"]


def test_gpu_bench_runs_the_graphed_train_py_row_on_cuda_only() -> None:
    from megatron_branchnorm.experiments import gpu_bench

    assert "train.py+graphs" in gpu_bench.SYSTEMS and "train.py+graphs" in gpu_bench.RUN_ORDER
    assert gpu_bench.loop_skip_reason("train.py+graphs", "cuda") is None
    assert "not run on the CPU" in gpu_bench.loop_skip_reason("train.py+graphs", "cpu")


def test_the_gpu_checks_recompute_dropout_row_passes_on_the_graph_double() -> None:
    """workflows/gpu_check's dropout row (a recompute against eager from the same random
    state) run through the graph double: its figure is 0 here, as it must be on a GPU."""
    from megatron_branchnorm.workflows.gpu_check import recompute_dropout_difference

    assert recompute_dropout_difference(cuda=graph_double, device="cpu") == 0.0
    assert recompute_dropout_difference(cuda=graph_double, device="cpu", links=True) == 0.0


@pytest.mark.parametrize("links", [False, True], ids=["range", "links"])
def test_the_gpu_checks_recompute_dropout_row_reads_nan_gradients_as_infinite(
    monkeypatch, links
) -> None:
    """A recompute whose gradients come back NaN (what a link reading memory that another
    graph of its pool overwrote gave on the pool-modelling double) reads inf, not the 0.0 of
    Python's max(), which skips a NaN."""
    from megatron_branchnorm.training import graph_capture
    from megatron_branchnorm.workflows.gpu_check import recompute_dropout_difference

    name = "CapturedChain" if links else "CapturedRange"

    class NaNGradients(getattr(graph_capture, name)):
        def recompute(self, *args):
            return super().recompute(*args) * float("nan")

    monkeypatch.setattr(graph_capture, name, NaNGradients)
    got = recompute_dropout_difference(cuda=graph_double, device="cpu", links=links)
    assert got == float("inf")


def test_the_trainer_recomputes_where_its_graphs_then_fit(monkeypatch, tmp_path) -> None:
    """The trainer's part of planner.RunPlan.graphs_pay, with the device's answers stood in
    (eager_reason as on a GPU, the device's memory set, install recorded): a stage that fits
    without recompute, but whose graphs find room for every bucket shape only with it,
    recomputes, install gets that interval and the allowance of the plan that recomputes,
    and the start-up line says why; with model.cuda_graphs=off the same stage does not."""
    from megatron_branchnorm.parallel.planner import MAX_GRAPHS, plan_run, stage_plan
    from megatron_branchnorm.resources import DS_CONFIG_DIR
    from megatron_branchnorm.training import environment, trainer
    from tests.core.helpers import one_rank_process_group

    cfg = load_config(
        "tiny_cpu",
        ["pipeline.activation_checkpoint_interval=auto", "data.bucket_shapes=auto",
         f"train.deepspeed_config={DS_CONFIG_DIR / 'zero1_bf16.json'}",
         f"train.save_dir={tmp_path}", "train.eval_interval=0"],
    )  # fmt: skip
    base = plan_run(cfg, 1, 1e12)
    s = base.stage_plans[0]
    wanted = min(48, MAX_GRAPHS // s.layer_ranges)
    # exactly room for every graph set beside a recomputing stage's one pool
    memory = s.total(True, base.overhead) + s.act_no_ckpt + s.graph_grad_bytes
    memory += (wanted + 0.5) * s.graph_set_bytes  # half a set: no rounding at the edge
    plan = stage_plan(cfg, 1, memory, graph_shapes=48)
    assert s.total(False, plan.overhead) <= memory  # it fits without recompute
    assert plan._graph_sets(plan.stage_plans[0], recompute=False)[1] < wanted
    assert plan.graph_sets(plan.stage_plans[0]) == (48, wanted)
    installed = []
    monkeypatch.setattr(environment, "device_memory_bytes", lambda: memory)
    monkeypatch.setattr(cuda_graphs, "eager_reason", lambda **_kw: None)
    monkeypatch.setattr(cuda_graphs, "install", lambda *a, **kw: installed.append(kw) or [])
    with one_rank_process_group():
        for mode in ("on", "off"):
            run = trainer.Trainer(dataclasses.replace(
                cfg, model=dataclasses.replace(cfg.model, cuda_graphs=mode)))  # fmt: skip
            got, line = installed[-1], run.describe_recompute()
            if mode == "on":
                assert run.ckpt_interval == 1 and run.recompute_for_graphs
                assert got["checkpoint_interval"] == 1
                assert got["memory"] == plan.graph_allowance(plan.stage_plans[0]) > 0
                assert "stage 0 recomputes every layer so that its CUDA graphs" in line
            else:
                assert run.ckpt_interval == 0 and not run.recompute_for_graphs
                assert got["checkpoint_interval"] == 0 and got["memory"] == 0.0
                assert "stage 0 does not recompute (" in line
            assert run.module.activation_checkpoint_interval == run.ckpt_interval
            del run


def test_the_trainer_cuts_a_recomputing_stage_into_the_links_the_planner_chose(
    monkeypatch, tmp_path
) -> None:
    """A stage that must recompute, on a device with room for one link's activations of 3
    layers in the graphs' pool but not for a whole range's (design §19, "Links"): install gets
    the planner's link length, with which every bucket shape's graph fits and none did; a
    length set in model.cuda_graph_link_layers is taken as set."""
    from megatron_branchnorm.parallel.planner import plan_run, stage_plan
    from megatron_branchnorm.resources import DS_CONFIG_DIR
    from megatron_branchnorm.training import environment, trainer
    from tests.core.helpers import one_rank_process_group

    cfg = load_config(
        "tiny_cpu",
        ["pipeline.activation_checkpoint_interval=auto", "data.bucket_shapes=4",
         f"train.deepspeed_config={DS_CONFIG_DIR / 'zero1_bf16.json'}",
         f"train.save_dir={tmp_path}", "train.eval_interval=0", "model.cuda_graphs=on"],
    )  # fmt: skip
    base = plan_run(cfg, 1, 1e12).with_shapes(4, True)
    s = base.stage_plans[0]
    assert [n for n, _, _ in s.graph_links] == [6, 6]
    memory = s.total(True, base.overhead) + base._pool(s, 3) + s.graph_grad_bytes
    memory += 4.5 * base.set_bytes(s, 3)  # room for 4 sets of links of 3 layers, and a half
    assert memory < s.total(False, base.overhead)  # it must recompute
    plan = stage_plan(cfg, 1, memory, graph_shapes=4)
    stage = plan.stage_plans[0]
    assert plan.link_layers(stage) == 3 and plan.graph_sets(stage) == (4, 4)
    assert plan._sets(stage, True, 0) == (4, 0)  # whole ranges: no graph fits
    installed = []
    monkeypatch.setattr(environment, "device_memory_bytes", lambda: memory)
    monkeypatch.setattr(cuda_graphs, "eager_reason", lambda **_kw: None)
    monkeypatch.setattr(cuda_graphs, "install", lambda *a, **kw: installed.append(kw) or [])
    with one_rank_process_group():
        run = trainer.Trainer(cfg)
        (got,) = installed
        assert run.ckpt_interval == 1 and got["checkpoint_interval"] == 1
        assert got["link_layers"] == 3 and got["memory"] == plan.graph_allowance(stage)
        del run
        set_links = dataclasses.replace(  # model.cuda_graph_link_layers is taken as set
            cfg, model=dataclasses.replace(cfg.model, cuda_graph_link_layers=2))  # fmt: skip
        run = trainer.Trainer(set_links)
        assert installed[-1]["link_layers"] == 2
        del run
