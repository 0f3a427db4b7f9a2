"""Side-by-side performance benchmark against fairseq, torchscale and torch.nn.Transformer.

    python tools/benchmark.py --quick                       # ~ a few minutes on 2 cores
    python tools/benchmark.py --sections model,trainstep --rounds 5 --json out.json

Sections (``--sections``, comma-separated; default all but ``data``, which takes 10-20 minutes):

- ``model``: the model step (forward, the same fp32 label-smoothed loss, backward, a plain
  torch.optim.Adam step; one loop shared by every implementation, bench_models.py) for
  ours and each anchor, fp32 and bf16 autocast. Each implementation is a persistent worker
  process; rounds interleave implementations and dtypes; figures are medians. Prints tokens/s
  (source + target), achieved GFLOP/s (matmul FLOPs of the configuration), the fraction of
  the matmul peak measured in the same run, and our ratio to each anchor. fairseq and
  torchscale run in the throwaway environment of bench_anchors.py.
- ``trainstep``: our whole training step through megatron_branchnorm/train.py (fused loss,
  optimizer, loop overheads) on synthetic data of the same shape, fp32 and bf16.
- ``pipeline``: train.py on 1 stage (1 thread) and on 2 stages (2 ranks, 1 thread each) with
  4/8/16 micro-batches; the bubble-limited ideal is t1 * (m + p - 1) / (m * p).
- ``deep``: a 500L-500L model at tiny width on 2 ranks: time to the first step, peak RSS per
  rank, parameters per rank.
- ``beam``: beam search (beam 4) sentences/s, ours (and ours at ``--baseline``, in the same
  process) vs transformers generate on our HF export; ``--beam-reps``, ``--beam-sentences``.
  Random weights by default (every sentence runs to its length limit); ``--beam-export E
  --beam-data D`` times a trained export on the first test sentences of each direction of D.
- ``preprocess``: tools/preprocess_data.py sentence pairs/s on a locale corpus.
- ``launches``: kernel-launching aten ops per encoder and decoder layer per micro-batch inside
  DeepSpeed's ``train_batch``, host syncs per micro-batch and the last stage's peak memory,
  for the shipped configs in ``--launch-configs`` (launches.py; issue 28). Counts, not
  timings: the load does not move them.
- ``data``: the data path at real size (bench_data.py; issue 29): for each N of
  ``--data-pairs`` a synthetic OPUS-100-shaped corpus of N pairs (cached in ``--workdir``),
  tools/preprocess_data.py's wall time and peak memory (per phase with its ``--stats``; the
  process tree's sampled RSS always), then for ``--data-train-pairs`` the training start-up
  (first update, peak RSS per rank) at 2 data-parallel ranks and at 4 stages, and a linear
  projection to 55M pairs. ``--checkout DIR`` measures another tree's tools (the "before"):

      python tools/benchmark.py --sections data --workdir /tmp/mbn_bench_data --json data.json

Always record the machine load: timings on a shared machine are noisy; ratios within one run
are what the script reports.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from megatron_branchnorm.experiments import bench_anchors, bench_models
from megatron_branchnorm.resources import DS_CONFIG_DIR
from megatron_branchnorm.runner.hardware import cpu_info, default_dtypes
from megatron_branchnorm.runner.launch import CHECKOUT, free_port, tool_command

SECTIONS = ("model", "trainstep", "pipeline", "deep", "beam", "preprocess", "launches", "data")


def load() -> str:
    """The 1/5/15-minute load averages."""
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')} load {load()}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Matmul peak
# ---------------------------------------------------------------------------------------------


def matmul_peak(
    threads: int,
    n: int = 2048,
    reps: int = 5,
    device: str = "cpu",
    dtypes: tuple[str, ...] = ("fp32", "bf16"),
) -> dict[str, float]:
    """Best-of GFLOP/s of an n x n x n matmul per dtype (n = 8192 on a GPU). Only the dtypes
    asked for: without AVX-512-bf16/AMX one bf16 2048^3 matmul takes minutes on a CPU."""
    import torch

    torch.set_num_threads(threads)
    n = 8192 if device != "cpu" else n
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        if name not in dtypes:
            continue
        a = torch.randn(n, n, dtype=dtype, device=device)
        b = torch.randn(n, n, dtype=dtype, device=device)
        a @ b
        sync()

        def mm(a=a, b=b) -> None:
            a @ b
            sync()

        best = min(_timed(mm) for _ in range(reps))
        out[name] = 2 * n**3 / best / 1e9
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Model step
# ---------------------------------------------------------------------------------------------


class Worker:
    """A bench_models.py process serving one implementation."""

    def __init__(self, impl: str, python: str, args: list[str], env: dict) -> None:
        self.impl = impl
        self.proc = subprocess.Popen(
            [python, "-m", "megatron_branchnorm.experiments.bench_models", "--impl", impl, *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{impl}: the worker exited before it was ready")
        self.info = json.loads(line)

    def run(self, dtype: str, steps: int) -> list[float]:
        self.proc.stdin.write(json.dumps({"dtype": dtype, "steps": steps}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())["times"]

    def close(self) -> None:
        try:
            self.proc.stdin.write('{"quit": true}\n')
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass
        self.proc.wait(timeout=60)


def bench_model(a: argparse.Namespace, peak: dict[str, float]) -> dict:
    """Interleaved model-step timings of every available implementation."""
    margs = [
        f"--layers={a.layers}", f"--dim={a.dim}", f"--ffn={a.ffn}", f"--heads={a.heads}",
        f"--vocab={a.vocab}", f"--batch={a.batch}", f"--src={a.src}", f"--tgt={a.tgt}",
        f"--dropout={a.dropout}", f"--threads={a.threads}", f"--device={a.device}",
    ]  # fmt: skip
    impls = [i for i in a.impls.split(",") if i]
    anchor_py, status = None, {}
    if {"fairseq", "torchscale"} & set(impls):
        log("preparing the anchors' environment (first time: minutes)")
        anchor_py = str(bench_anchors.prepare_anchor_env())
        status = bench_anchors.anchor_status()
    skipped: dict[str, str] = {}
    env = dict(os.environ, **bench_anchors.ANCHOR_ENV)
    # the workers import bench_models from this checkout (the anchors' python has no install)
    env["PYTHONPATH"] = os.pathsep.join([str(CHECKOUT), os.environ.get("PYTHONPATH", "")])
    specs = {}  # impl -> (worker impl, python, extra args)
    for impl in impls:
        if impl in ("fairseq", "torchscale") and status.get(impl) != "ok":
            skipped[impl] = status.get(impl, "not prepared")
        elif impl in ("fairseq", "torchscale"):
            specs[impl] = (impl, anchor_py, [])
        elif impl == "base":
            specs[impl] = ("ours", sys.executable, [f"--root={a.base}"])
        else:
            specs[impl] = (impl, sys.executable, [])
    dtypes = a.dtypes.split(",")
    # One worker alive at a time (memory on a shared machine); every round starts each
    # implementation afresh, warms it up and times it, in alternating order.
    times: dict[str, dict[str, list[float]]] = {i: {d: [] for d in dtypes} for i in specs}
    params = {}
    for r in range(a.rounds):
        order = list(specs) if r % 2 == 0 else list(reversed(specs))
        for impl in order:
            if impl in skipped:
                continue
            wimpl, py, extra = specs[impl]
            try:
                w = Worker(wimpl, py, [*margs, *extra], env)
            except Exception as e:  # noqa: BLE001 - reported as skipped
                skipped[impl] = str(e)
                continue
            params[impl] = w.info["params"]
            for dt in dtypes:
                w.run(dt, a.warmup)  # allocator, autocast caches, Adam state
                times[impl][dt] += w.run(dt, a.steps)
                log(f"model step {impl}/{dt}: {[round(t, 3) for t in times[impl][dt]]} s")
            w.close()
        log(f"round {r + 1}/{a.rounds} done")
    workers = [i for i in specs if i not in skipped]
    times = {i: times[i] for i in workers}
    tokens = a.batch * (a.src + a.tgt)
    flops = bench_models.model_flops(a.layers, a.dim, a.ffn, a.vocab, a.batch, a.src, a.tgt)
    rows = {}
    for impl, per_dtype in times.items():
        for dt, ts in per_dtype.items():
            med = statistics.median(ts)
            rows[f"{impl}/{dt}"] = {
                "s_per_step": med,
                "tokens_per_s": tokens / med,
                "gflops": flops / med / 1e9,
                "frac_peak": flops / med / 1e9 / peak[dt],
                "n": len(ts),
                "spread": (min(ts), max(ts)),
            }
    ratios = {}
    for dt in dtypes:
        ours = rows.get(f"ours/{dt}")
        for impl in workers:
            if impl != "ours" and ours and f"{impl}/{dt}" in rows:
                ratios[f"ours/{impl} {dt}"] = (
                    ours["tokens_per_s"] / rows[f"{impl}/{dt}"]["tokens_per_s"]
                )
    if "ours/fp32" in rows and "ours/bf16" in rows:
        ratios["ours bf16/fp32"] = (
            rows["ours/bf16"]["tokens_per_s"] / rows["ours/fp32"]["tokens_per_s"]
        )
    return {
        "config": f"{a.layers}L-{a.layers}L d={a.dim} ffn={a.ffn} heads={a.heads} "
        f"vocab={a.vocab} batch={a.batch}x({a.src}+{a.tgt}) dropout={a.dropout}",
        "gflop_per_step": flops / 1e9,
        "rows": rows,
        "ratios": ratios,
        "skipped": skipped,
        "params": params,
    }


# ---------------------------------------------------------------------------------------------
# train.py runs (trainstep, pipeline, deep)
# ---------------------------------------------------------------------------------------------


def train_run(
    overrides: list[str],
    ranks: int,
    threads_per_rank: int,
    save_dir: Path,
    timeout: float,
    root: Path = CHECKOUT,
) -> dict:
    """Run train.py of the tree ``root`` (ranks started directly, as under srun, in ``root``);
    returns metrics records, wall time to the first record, total wall time and the peak RSS
    of each rank (MiB)."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "megatron_branchnorm.train", "--config", "tiny_cpu",
        f"train.save_dir={save_dir}", "train.save_interval=0", "train.eval_interval=100000",
        "train.log_interval=1", *overrides,
    ]  # fmt: skip
    metrics = save_dir / "metrics.jsonl"
    t0 = time.time()
    procs = []
    for rank in range(ranks):
        env = dict(
            os.environ, RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_RANK=str(rank),
            LOCAL_SIZE=str(max(1, (os.cpu_count() or 2) // threads_per_rank)),
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
        )  # fmt: skip
        save_dir.mkdir(parents=True, exist_ok=True)
        with open(save_dir / f"rank{rank}.log", "w") as out:
            procs.append(subprocess.Popen(cmd, env=env, cwd=root, stdout=out, stderr=out))
    first = None
    peaks = [0.0] * ranks
    done = [False] * ranks
    while not all(done):
        if first is None and metrics.exists() and metrics.stat().st_size:
            first = time.time() - t0
        for i, p in enumerate(procs):
            if not done[i]:
                pid, status, usage = os.wait4(p.pid, os.WNOHANG)
                if pid:
                    done[i], peaks[i] = True, usage.ru_maxrss / 1024.0
                    p.returncode = os.waitstatus_to_exitcode(status)
        if time.time() - t0 > timeout:
            for p in procs:
                p.kill()
            raise RuntimeError(f"train.py timed out after {timeout:.0f}s: {overrides}")
        time.sleep(0.05)
    wall = time.time() - t0
    # DeepSpeed's CPU backend leaves a shared-memory all-reduce buffer per rank in /dev/shm
    # (~66 MB each); remove the ones of this run (named after its port).
    for leftover in Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_*_{port}_*"):
        leftover.unlink(missing_ok=True)
    if any(p.returncode for p in procs):
        tail = (save_dir / "rank0.log").read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"train.py failed ({[p.returncode for p in procs]}): {tail}")
    records = [json.loads(x) for x in metrics.read_text().splitlines() if x.strip()]
    records = [r for r in records if "tokens_per_sec" in r]
    return {"records": records, "first_step_s": first, "wall_s": wall, "peak_rss_mb": peaks}


def _model_overrides(a: argparse.Namespace, layers: int | None = None) -> list[str]:
    n = layers or a.layers
    return [
        f"model.encoder_layers={n}", f"model.decoder_layers={n}", f"model.hidden_size={a.dim}",
        f"model.ffn_hidden_size={a.ffn}", f"model.num_attention_heads={a.heads}",
        f"model.vocab_size={a.vocab}", f"model.dropout={a.dropout}", "model.max_positions=128",
        "train.warmup_steps=100", "train.lr=5e-4", "train.clip_grad=0.0",
    ]  # fmt: skip


def bench_trainstep(a: argparse.Namespace, work: Path) -> dict:
    """Our whole training step through train.py (1 process, all cores), fp32 and bf16.

    Synthetic copy/reverse data, max_length = src so a micro-batch holds ~max_tokens
    tokens per side (source + target tokens are counted, pads not)."""
    out: dict = {}
    steps = a.warmup + a.steps * (1 if a.quick else 2)
    trees = {"ours": CHECKOUT}
    if a.base:
        trees["base"] = Path(a.base)
    for rnd in range(1 if a.quick else 2):
        for dt in a.dtypes.split(","):
            ds = DS_CONFIG_DIR / ("cpu_fp32.json" if dt == "fp32" else "zero1_bf16.json")
            if dt == "bf16":  # ZeRO-1 refuses our AdamW subclass unless told (see performance.md)
                conf = json.loads(ds.read_text())
                conf["zero_allow_untested_optimizer"] = True
                ds = work / "zero1_bf16_allow.json"
                ds.write_text(json.dumps(conf))
            for name, root in trees.items():
                save = work / f"trainstep_{name}_{dt}_{rnd}"
                shutil.rmtree(save, ignore_errors=True)
                ov = _model_overrides(a) + [
                    f"data.max_tokens={a.batch * a.src}", f"data.max_length={a.src}",
                    "train.micro_batches=1", f"train.max_steps={steps}",
                    f"train.deepspeed_config={ds}",
                ]  # fmt: skip
                res = train_run(ov, 1, a.threads, save, a.timeout, root)
                tps = [r["tokens_per_sec"] for r in res["records"][a.warmup :]]
                out.setdefault(f"{name}/{dt}", []).extend(tps)
                log(f"trainstep {name} {dt}: {statistics.median(tps):.0f} tokens/s")
    summary = {k: {"tokens_per_s": statistics.median(v), "n": len(v)} for k, v in out.items()}
    for dt in a.dtypes.split(","):
        if f"base/{dt}" in summary:
            summary[f"ours/base {dt}"] = (
                summary[f"ours/{dt}"]["tokens_per_s"] / summary[f"base/{dt}"]["tokens_per_s"]
            )
    return summary


def bench_pipeline(a: argparse.Namespace, work: Path) -> dict:
    """1 stage (1 thread) vs 2 stages x 1 thread, against the bubble-limited ideal.

    Rounds interleave the 1-stage run and the 2-stage runs, so a drift of the machine's speed
    moves the reference and the pipeline alike; figures are medians over all rounds' updates
    (the first update of each run, which includes warm-up, is left out)."""
    base = [
        "model.encoder_layers=6", "model.decoder_layers=6", "model.hidden_size=128",
        "model.ffn_hidden_size=512", "model.num_attention_heads=4", "model.vocab_size=1000",
        "model.dropout=0.1", "data.max_tokens=256", "data.max_length=32",
    ]  # fmt: skip
    mbs = [8] if a.quick else [4, 8, 16]
    steps = 3 if a.quick else 10
    rounds = 1 if a.quick else 2
    t1s: list[float] = []
    t2s: dict[int, list[float]] = {m: [] for m in mbs}
    for rnd in range(rounds):
        save = work / f"pipe1_r{rnd}"
        shutil.rmtree(save, ignore_errors=True)
        r1 = train_run(
            base + ["train.micro_batches=8", f"train.max_steps={steps}"], 1, 1, save, a.timeout
        )
        t1s += [r["tokens_per_sec"] for r in r1["records"][1:]]  # one rank, one thread
        for m in mbs:
            save = work / f"pipe2_m{m}_r{rnd}"
            shutil.rmtree(save, ignore_errors=True)
            r2 = train_run(
                base + [f"train.micro_batches={m}", f"train.max_steps={steps}", "pipeline.stages=2"],
                2, 1, save, a.timeout,
            )  # fmt: skip
            t2s[m] += [r["tokens_per_sec"] for r in r2["records"][1:]]
        log(f"pipeline round {rnd + 1}/{rounds} done")
    t1 = statistics.median(t1s)
    out: dict = {"1stage_tokens_per_s": t1, "rounds": rounds, "updates_per_run": steps - 1}
    for m in mbs:
        t2 = statistics.median(t2s[m])
        ideal = t1 * 2 * m / (m + 1)  # p=2: t1 * p * m / (m + p - 1)
        out[f"2stage_m{m}"] = {"tokens_per_s": t2, "ideal": ideal, "frac_ideal": t2 / ideal}
        log(f"pipeline m={m}: {t2:.0f} tokens/s = {t2 / ideal:.0%} of ideal {ideal:.0f}")
    return out


def bench_deep(a: argparse.Namespace, work: Path) -> dict:
    """A 500L-500L model at tiny width on 2 ranks: first step, peak RSS per rank."""
    n = 500
    save = work / "deep"
    shutil.rmtree(save, ignore_errors=True)
    ov = [
        f"model.encoder_layers={n}", f"model.decoder_layers={n}", "model.hidden_size=32",
        "model.ffn_hidden_size=64", "model.num_attention_heads=2", "model.vocab_size=64",
        "data.max_tokens=128", "train.micro_batches=2", "train.max_steps=1", "pipeline.stages=2",
    ]  # fmt: skip
    res = train_run(ov, 2, 1, save, a.timeout)
    out = {
        "first_step_s": res["first_step_s"],
        "wall_s": res["wall_s"],
        "peak_rss_mb_per_rank": res["peak_rss_mb"],
    }
    log(f"500L-500L: first step at {res['first_step_s']:.1f}s, peak RSS {res['peak_rss_mb']}")
    return out


# ---------------------------------------------------------------------------------------------
# Beam search vs transformers generate
# ---------------------------------------------------------------------------------------------


def _import_beam_tree(root: str) -> tuple:
    """(ModelConfig, build_model, beam_search) of the package under ``root`` (another git
    revision), beside this tree's (bench_models.import_tree)."""
    names = ["config", "model", "inference.beam_search"]
    config, model, search = bench_models.import_tree(
        root, [f"megatron_branchnorm.{name}" for name in names]
    )
    return config.ModelConfig, model.build_model, search.beam_search


def _beam_random(a: argparse.Namespace):
    """(model, [src batch], banned ids, description): random Post-LN weights, one batch of
    random source sentences (random weights rarely emit EOS: every sentence runs to its
    length limit)."""
    import torch

    from megatron_branchnorm.config import ModelConfig
    from megatron_branchnorm.model import build_model
    from megatron_branchnorm.tokens import BOS_ID, EOS_ID, PAD_ID

    layers = 6
    cfg = ModelConfig(
        encoder_layers=layers, decoder_layers=layers, hidden_size=a.dim, ffn_hidden_size=a.ffn,
        num_attention_heads=a.heads, vocab_size=a.vocab, residual="postln", dropout=0.0,
        max_positions=128,
    )  # fmt: skip
    model = build_model(cfg).eval()
    g = torch.Generator().manual_seed(0)
    nsent = a.beam_sentences or (16 if a.quick else 32)
    slen = 12 if a.quick else 16
    src = torch.randint(EOS_ID + 1, a.vocab, (nsent, slen), generator=g)
    src[:, -1] = EOS_ID
    desc = (
        f"random weights, {layers}L-{layers}L d={a.dim} vocab={a.vocab}, "
        f"{nsent} random sentences of {slen}"
    )
    return model, [src], [PAD_ID, BOS_ID], desc


def _beam_export(a: argparse.Namespace):
    """(model, [src batch per direction], banned ids, description): a trained export and the
    first ``--beam-sentences`` (0: 32) test sentences of every direction of ``--beam-data``,
    encoded as translate.py encodes them; a direction's sentences are one batch."""
    from megatron_branchnorm.inference.evaluate import references_from_manifest
    from megatron_branchnorm.inference.translate import Translator, pad_sources

    tr = Translator.from_export(a.beam_export)
    per_dir = a.beam_sentences or 32
    batches = []
    for d in references_from_manifest(a.beam_data, "test").values():
        lines = [x for x in d.src_path.read_text(encoding="utf-8").splitlines() if x.strip()]
        batches.append(pad_sources([tr.encode(x, d.tgt_lang) for x in lines[:per_dir]]))
    c = tr.model.cfg
    desc = (
        f"export {a.beam_export} ({c.residual} {c.encoder_layers}L-{c.decoder_layers}L "
        f"d={c.hidden_size} vocab={c.vocab_size}), {sum(map(len, batches))} test sentences of "
        f"{a.beam_data} ({len(batches)} directions, a batch each)"
    )
    return tr.model, batches, tr.banned_ids, desc


def bench_beam(a: argparse.Namespace, work: Path) -> dict:
    """Sentences/s of beam search (beam 4, lenpen 0.6) on the same weights: ours (and with
    ``--baseline``, ours at that revision) and MarianMTModel.generate on our HF export,
    interleaved; figures are medians over ``--beam-reps`` repetitions. Random weights, or with
    ``--beam-export``/``--beam-data`` a trained export on real test sentences."""
    import dataclasses

    import torch
    from transformers import MarianMTModel

    from megatron_branchnorm.inference.beam_search import beam_search, max_lengths
    from megatron_branchnorm.inference.hf_export import export_hf
    from megatron_branchnorm.inference.translate import SearchOptions
    from megatron_branchnorm.tokens import EOS_ID, PAD_ID

    torch.set_num_threads(a.threads)
    if a.beam_export:
        model, batches, banned, desc = _beam_export(a)
    else:
        model, batches, banned, desc = _beam_random(a)
    hf_dir = work / "hf"
    shutil.rmtree(hf_dir, ignore_errors=True)
    export_hf(model, hf_dir, verify=False)
    hf = MarianMTModel.from_pretrained(str(hf_dir)).eval()
    hf.generation_config.max_length = None  # max_new_tokens below sets the limit
    nsent = sum(len(src) for src in batches)
    # Our length limit per sentence (beam_search's defaults, as translate.py's); generate takes
    # one per batch: the longest of ours in it.
    opts = SearchOptions()
    own = [max_lengths(s, opts.max_len_a, opts.max_len_b, model.cfg.max_positions) for s in batches]
    limits = [int(x.max()) for x in own]

    def search_fn(search, net):
        def run() -> list:
            out = []
            for src in batches:
                hyps = search(net, src, beam=4, lenpen=0.6, banned_ids=banned)
                out += [h[0].tokens for h in hyps]
            return out

        return run

    def theirs() -> list:
        out = []
        with torch.no_grad():
            for src, limit in zip(batches, limits, strict=True):
                ids = hf.generate(
                    input_ids=src, attention_mask=src.ne(PAD_ID).long(), num_beams=4,
                    length_penalty=0.6, max_new_tokens=limit + 1, early_stopping=True,
                    do_sample=False, bad_words_ids=[[i] for i in banned],
                )  # fmt: skip
                out += [[t for t in row[1:] if t not in (PAD_ID, EOS_ID)] for row in ids.tolist()]
        return out

    fns = {"ours": search_fn(beam_search, model)}
    if a.base:
        base_config, base_build, base_search = _import_beam_tree(a.base)
        base_model = base_build(base_config(**dataclasses.asdict(model.cfg))).eval()
        base_model.load_state_dict(model.state_dict())
        base_model.set_step(model.step)
        fns["base"] = search_fn(base_search, base_model)
    fns["hf"] = theirs
    times: dict[str, list[float]] = {name: [] for name in fns}
    outs = {name: fn() for name, fn in fns.items()}  # warm-up
    reps = a.beam_reps or (1 if a.quick else 3)
    for rep in range(reps):
        names = list(fns) if rep % 2 == 0 else list(reversed(fns))  # alternate the order
        for name in names:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    res = {
        "config": desc,
        "threads": a.threads,
        "reps": reps,
        "times_s": {name: [round(t, 3) for t in ts] for name, ts in times.items()},
        "generated_tokens": {name: sum(map(len, out)) for name, out in outs.items()},
    }
    for name, ts in times.items():
        res[f"{name}_sent_per_s"] = nsent / statistics.median(ts)
    res["ratio"] = res["ours_sent_per_s"] / res["hf_sent_per_s"]
    res["same_as_hf"] = sum(x == y for x, y in zip(outs["ours"], outs["hf"], strict=True))
    res["sentences"] = nsent
    # ours stops a sentence at its own limit, generate at its batch's longest: a sentence that
    # reaches its limit may differ for that reason alone
    res["ours_at_limit"] = sum(
        len(h) >= n for h, n in zip(outs["ours"], torch.cat(own).tolist(), strict=True)
    )
    if "base" in fns:
        res["ratio_base"] = res["base_sent_per_s"] / res["hf_sent_per_s"]
        res["ours_over_base"] = res["ours_sent_per_s"] / res["base_sent_per_s"]
        res["same_as_base"] = outs["ours"] == outs["base"]
    log(f"beam: ours/hf = {res['ratio']:.2f}")
    return res


# ---------------------------------------------------------------------------------------------
# Preprocessing
# ---------------------------------------------------------------------------------------------


def bench_preprocess(a: argparse.Namespace, work: Path) -> dict:
    """Sentence pairs/s of tools/preprocess_data.py on a locale corpus (built here)."""
    corpus = work / "corpus"
    if not corpus.exists():
        subprocess.run(
            [*tool_command("corpus"), "--output", str(corpus), "--langs", "de,fr"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=CHECKOUT,
        )  # fmt: skip
    out_dir = work / "data"
    shutil.rmtree(out_dir, ignore_errors=True)
    t0 = time.perf_counter()
    subprocess.run(
        [*tool_command("preprocess"), "--format", "opus100",
         "--input", str(corpus), "--langs", "de,fr", "--output", str(out_dir),
         "--vocab-size", "2000"],
        check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=CHECKOUT,
    )  # fmt: skip
    wall = time.perf_counter() - t0
    manifest = json.loads((out_dir / "manifest.json").read_text())
    pairs = _count_pairs(manifest)
    res = {"pairs": pairs, "wall_s": wall, "pairs_per_s": pairs / wall if pairs else None}
    log(f"preprocess: {pairs} pairs in {wall:.1f}s")
    return res


def _count_pairs(manifest: dict) -> int:
    """Raw sentence pairs read, over every split and language pair of a data manifest."""
    return sum(
        int(pair.get("raw_sentences", pair.get("sentences", 0)))
        for split in manifest.get("splits", {}).values()
        for pair in split.get("pairs", {}).values()
    )


# ---------------------------------------------------------------------------------------------
# Kernel launches per layer
# ---------------------------------------------------------------------------------------------


def bench_launches(a: argparse.Namespace, work: Path) -> dict:
    """Kernel-launching ops per layer per micro-batch, host syncs and the last stage's peak
    memory of each config in ``--launch-configs`` (launches.measure)."""
    from megatron_branchnorm.experiments import launches  # torch: only when this section runs

    configs = [c for c in (a.launch_configs or ",".join(launches.DEFAULT_CONFIGS)).split(",") if c]
    res = launches.measure(configs, timeout=a.timeout)
    for name, r in res["configs"].items():
        log(
            f"launches {name}: enc {r['enc_ops_per_layer_mb']:.1f}, dec "
            f"{r['dec_ops_per_layer_mb']:.1f} ops/layer/micro-batch, "
            f"{r['host_syncs_per_mb']:.2f} host syncs/micro-batch"
        )
    return res


def _pair_list(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def bench_data(a: argparse.Namespace, work: Path) -> dict:
    """Preprocessing and training start-up on synthetic OPUS-100-shaped corpora
    (bench_data.measure)."""
    from megatron_branchnorm.experiments import bench_data as bd

    quick = a.quick and a.data_pairs is None
    pairs = (
        _pair_list(a.data_pairs)
        if a.data_pairs
        else list(bd.QUICK_PAIRS if quick else bd.DEFAULT_PAIRS)
    )
    if a.data_train_pairs is not None:
        train = _pair_list(a.data_train_pairs)
    else:
        train = [min(pairs)] if quick else list(bd.DEFAULT_TRAIN_PAIRS)
    checkout = Path(a.checkout) if a.checkout else CHECKOUT
    vocab = a.data_vocab_size or (16000 if quick else 64000)
    return bd.measure(work, checkout, pairs, train, vocab, a.data_workers, a.timeout, log=log)


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def print_report(res: dict) -> None:
    print(f"# benchmark {res['date']}  ({res['machine']})")
    print(f"command: {res['command']}")
    print(f"load at start/end: {res['load_start']} / {res['load_end']}")
    if "cpu" in res:
        print(f"{res['cpu']}; precisions run: {res['dtypes']}")
    if "peak" in res:
        peaks = ", ".join(f"{k} {v:.0f} GFLOP/s" for k, v in res["peak"].items())
        print(f"matmul peak: {peaks}")
    if "model" in res:
        m = res["model"]
        print(f"\n## model step: {m['config']} ({m['gflop_per_step']:.0f} GFLOP/step)")
        print(f"{'impl/dtype':<18}{'s/step':>8}{'tokens/s':>10}{'GFLOP/s':>9}{'of peak':>9}  n")
        for k, r in m["rows"].items():
            print(
                f"{k:<18}{r['s_per_step']:>8.3f}{r['tokens_per_s']:>10.0f}{r['gflops']:>9.0f}"
                f"{r['frac_peak']:>9.1%}  {r['n']}"
            )
        for k, v in m["ratios"].items():
            print(f"ratio {k}: {v:.2f}x")
        for k, v in m["skipped"].items():
            print(f"skipped {k}: {v}")
    for key in ("trainstep", "pipeline", "deep", "beam", "preprocess"):
        if key in res:
            print(f"\n## {key}\n{json.dumps(res[key], indent=1)}")
    if "launches" in res:
        from megatron_branchnorm.experiments.launches import format_table

        r = res["launches"]
        text = json.dumps(r) if "error" in r else format_table(r)
        print(f"\n## launches (kernel-launching ops per layer per micro-batch)\n{text}")
    if "data" in res:
        from megatron_branchnorm.experiments.bench_data import format_table

        r = res["data"]
        text = json.dumps(r) if "error" in r else format_table(r)
        print(f"\n## data (synthetic OPUS-100-shaped corpora; issue 29)\n{text}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bench_models.add_model_args(p)
    p.add_argument("--quick", action="store_true", help="short version (1 round, fewer runs)")
    p.add_argument(
        "--sections",
        default=",".join(s for s in SECTIONS if s != "data"),
        help=f"of {','.join(SECTIONS)} (default all but data)",
    )
    p.add_argument("--impls", default="ours,torch,fairseq,torchscale")
    p.add_argument(
        "--dtypes",
        default=None,
        help="fp32,bf16 (default on a CPU: bf16 only where the CPU has AVX-512-BF16 or AMX)",
    )
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (model step)")
    p.add_argument("--steps", type=int, default=2, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per worker and dtype")
    p.add_argument("--timeout", type=float, default=900.0, help="per train.py run (s)")
    p.add_argument("--workdir", default=None, help="scratch directory (default: a temp dir)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--beam-sentences",
        type=int,
        default=0,
        help="beam: sentences (per direction with --beam-export; 0: 32)",
    )
    p.add_argument("--beam-reps", type=int, default=0, help="beam: timed repetitions (0: 3)")
    p.add_argument(
        "--beam-export",
        default=None,
        help="beam: a trained export (tools/convert_checkpoint.py) instead of random weights",
    )
    p.add_argument(
        "--beam-data", default=None, help="beam: with --beam-export, its DATA_DIR (test split)"
    )
    p.add_argument(
        "--launch-configs",
        default=None,
        help="launches: the shipped configs whose ops per layer are counted "
        "(default: opus100_12L,opus100_200L,opus100_1000L)",
    )
    p.add_argument(
        "--data-pairs",
        default=None,
        help="data: corpus sizes to preprocess (default 250000,1000000,4000000; --quick "
        "20000,60000)",
    )
    p.add_argument(
        "--data-train-pairs",
        default=None,
        help="data: sizes whose DATA_DIR is also trained on at 2 ranks and 4 stages (default "
        "1000000; --quick the smallest; '' none)",
    )
    p.add_argument(
        "--data-vocab-size",
        type=int,
        default=None,
        help="data: --vocab-size (default 64000; --quick 16000: a small corpus has too few pieces)",
    )
    p.add_argument("--data-workers", type=int, default=2, help="data: --workers")
    p.add_argument(
        "--checkout",
        default=None,
        help="data: run this tree's tools/preprocess_data.py and train (PYTHONPATH=DIR)",
    )
    p.add_argument(
        "--baseline",
        default=None,
        help="a git revision of this repo: also time our code at that revision ('base')",
    )
    a = p.parse_args()
    cpu = cpu_info()
    log(cpu.describe())
    if a.dtypes is None:
        a.dtypes = ",".join(default_dtypes(cpu) if a.device == "cpu" else ("fp32", "bf16"))
        if a.device == "cpu" and not cpu.native_bf16:
            log("bf16 sections skipped: no native bf16 on this CPU (--dtypes fp32,bf16 forces)")
    if a.quick:
        a.rounds, a.steps = 1, 2
    sections = [s for s in a.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        p.error(f"unknown sections {sorted(unknown)} (of {', '.join(SECTIONS)})")
    if bool(a.beam_export) != bool(a.beam_data):
        p.error("--beam-export and --beam-data go together")
    # absolute: train.py runs in the tree it times (--baseline: another one)
    work = Path(a.workdir).resolve() if a.workdir else Path(tempfile.mkdtemp(prefix="mbn_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    a.base = None
    if a.baseline:
        a.base = str(work / "base")
        shutil.rmtree(a.base, ignore_errors=True)
        os.makedirs(a.base)
        tar = subprocess.run(
            ["git", "-C", str(CHECKOUT), "archive", a.baseline, "megatron_branchnorm"],
            check=True, capture_output=True,
        ).stdout  # fmt: skip
        subprocess.run(["tar", "-x", "-C", a.base], input=tar, check=True)
        if "base" not in a.impls.split(","):
            a.impls = f"{a.impls},base"
    res: dict = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "command": " ".join(["python", "tools/benchmark.py", *sys.argv[1:]]),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "load_start": load(),
        "cpu": cpu.describe(),
        "dtypes": a.dtypes,
    }
    if a.device != "cpu":
        import torch

        res["machine"] += f", {torch.cuda.get_device_name()}"
    if "model" in sections:
        res["peak"] = matmul_peak(a.threads, device=a.device, dtypes=tuple(a.dtypes.split(",")))
        log(f"matmul peak {res['peak']}")
        res["model"] = bench_model(a, res["peak"])
    runners = {
        "trainstep": bench_trainstep,
        "pipeline": bench_pipeline,
        "deep": bench_deep,
        "beam": bench_beam,
        "preprocess": bench_preprocess,
        "launches": bench_launches,
        "data": bench_data,
    }
    for name, fn in runners.items():
        if name in sections:
            try:
                res[name] = fn(a, work)
            except Exception as e:  # noqa: BLE001 - one failed section does not lose the rest
                res[name] = {"error": f"{type(e).__name__}: {e}"}
                log(f"{name} failed: {e}")
    res["load_end"] = load()
    if a.json:  # before the report: a report bug must not lose the figures
        Path(a.json).write_text(json.dumps(res, indent=1))
    print_report(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
