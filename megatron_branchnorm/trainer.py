"""The training loop on DeepSpeed's pipeline engine (DESIGN.md §4, §8).

One code path for every topology: a single process is a 1-stage pipeline. Each update:

1. every rank draws the update's ``micro_batches x dp`` micro-batches from one global,
   seed-determined stream (so the order never depends on max_steps or on the topology) and
   keeps its data-parallel share; the global target-token count N is known to all ranks;
2. every stage sets BranchNorm's alpha_t for t = applied updates + 1 (a Python float);
3. ``engine.train_batch()``; the loss is normalised per target token of the whole update;
4. logging, validation, checkpoints, and a collective check for SIGUSR1/SIGTERM (save, exit
   with REQUEUE_EXIT_CODE) and for the wall-clock budget (save, exit 0).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import hashlib
import json
import logging
import math
import os
import resource
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from megatron_branchnorm import checkpoint as ckpt
from megatron_branchnorm import resume_policy, retention, stop_signals
from megatron_branchnorm.cli import describe_os_error, one_line, quote
from megatron_branchnorm.config import ConfigError, ExperimentConfig, dump_config
from megatron_branchnorm.lr_schedule import inverse_sqrt_factor
from megatron_branchnorm.model.residual import describe_layernorm
from megatron_branchnorm.partition import describe_plan, partition_plan, spec_names
from megatron_branchnorm.patience import Patience, format_eta
from megatron_branchnorm.pipeline import (
    PipeLoss,
    build_pipeline_module,
    install_engine_fixes,
    pipe_to_flat_key,
    set_pipeline_step,
)
from megatron_branchnorm.run_lock import LockError, RunLock
from megatron_branchnorm.tokens import PAD_ID

logger = logging.getLogger("megatron_branchnorm")


class TrainError(RuntimeError):
    """A failure every rank reports the same way (one line, exit 2): a full disk during a
    save, a save_dir held by another run."""


REQUEUE_EXIT_CODE = 75
"""Exit code after a signal-triggered checkpoint (EX_TEMPFAIL): job scripts requeue on it."""
NONFINITE_EXIT_CODE = 3
"""Exit code after train.max_consecutive_skips consecutive non-finite updates (no save)."""
FAULT_ENV = "MBN_FAULT_INJECT"
"""Test-only fault injection, read once when a Trainer is built (tests/faults, docs/reliability.md).

Comma-separated items:
``nan_loss@T[xN]``: the loss of update T is NaN (its first N attempts; default 1);
``inf_grad@T[xN][:stageS]``: one gradient element on stage S (default the last) is +inf;
``save_exit@POINT[:rankR][:stepN]``: rank R (default 0) calls ``os._exit(FAULT_EXIT_CODE)``
at POINT of the save at step N (default the first save); POINT is one of SAVE_POINTS;
``slow@SECONDS``: sleep before every update (gives a test time to kill a rank mid-run);
``enospc@PHASE[:rankR]``: rank R (default 0) gets ENOSPC ("no space left on device") in PHASE:
``engine`` (its files of a save), ``manifest`` (rank 0's files of a save), ``metrics`` (rank 0's
``metrics.jsonl``).
"""
FAULT_EXIT_CODE = 86
SAVE_POINTS = ("engine_file", "after_engine", "after_rng", "after_config", "after_manifest")
"""Where a save can be cut: after DeepSpeed's first file of this rank, after DeepSpeed's
save, after the RNG file, after train_config.json, after the manifest (``latest`` not moved)."""

FP16_ON_CPU_ENV = "MBN_TEST_FP16_ON_CPU"
"""Test-only emulation: with ``1`` here, DeepSpeed's CPU accelerator reports fp16 as
supported, so the fp16 engine path (DeepSpeed's ZeRO-1 optimizer with dynamic loss scaling)
runs on CPU ranks in the test suite. What it proves and what only a GPU can: docs/design.md
§7. Never set it for a real run: on most CPUs fp16 compute is emulated and slow."""

YAML_OWNED_DS_KEYS = {
    "train_batch_size": "train.micro_batches",
    "train_micro_batch_size_per_gpu": "data.max_tokens",
    "gradient_accumulation_steps": "train.micro_batches",
    "gradient_clipping": "train.clip_grad",
    "optimizer": "train.lr / train.adam_*",
    "scheduler": "train.lr / train.warmup_steps",
}


# --------------------------------------------------------------------------------------------
# Process set-up
# --------------------------------------------------------------------------------------------


def setup_process_env() -> None:
    """Fill RANK/WORLD_SIZE/LOCAL_RANK/MASTER_* for a single process or from SLURM, so
    ``deepspeed.init_distributed`` never falls into MPI discovery."""
    env = os.environ
    if "RANK" not in env and "SLURM_PROCID" in env and "MASTER_ADDR" in env:
        env["RANK"] = env["SLURM_PROCID"]
        env["WORLD_SIZE"] = env.get("SLURM_NTASKS", "1")
        env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
        env.setdefault("LOCAL_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    if "RANK" not in env:
        env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"] = "0", "1", "0"
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in env:
            import socket

            with socket.socket() as sock:
                sock.bind(("127.0.0.1", 0))
                env["MASTER_PORT"] = str(sock.getsockname()[1])
    env.setdefault("LOCAL_RANK", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")


def set_thread_count() -> int:
    """torch threads = cores / local ranks (the launcher sets OMP only with core binding)."""
    local = int(os.environ.get("LOCAL_SIZE") or os.environ.get("LOCAL_WORLD_SIZE") or 0)
    if local <= 0:
        local = int(os.environ.get("WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = max(1, (cores or 1) // max(1, local))
    if "OMP_NUM_THREADS" in os.environ:
        raw = os.environ["OMP_NUM_THREADS"]
        if not raw.strip().isdigit() or int(raw) < 1:
            raise ConfigError(
                f"environment variable OMP_NUM_THREADS: expected a count >= 1, got {raw!r}"
            )
        threads = int(raw)
    torch.set_num_threads(threads)
    return threads


DS_SCALAR_TYPES: dict[str, dict[str, type]] = {
    "": {
        "steps_per_print": int,
        "wall_clock_breakdown": bool,
        "memory_breakdown": bool,
        "prescale_gradients": bool,
        "gradient_predivide_factor": float,
        "zero_allow_untested_optimizer": bool,
        "dump_state": bool,
        "dataloader_drop_last": bool,
    },
    "fp16": {
        "enabled": bool,
        "loss_scale": float,
        "initial_scale_power": int,
        "loss_scale_window": int,
        "hysteresis": int,
        "consecutive_hysteresis": bool,
        "min_loss_scale": float,
        "auto_cast": bool,
    },
    "bf16": {"enabled": bool, "immediate_grad_update": bool},
    "zero_optimization": {"stage": int},
}
"""Types of the DeepSpeed JSON keys DeepSpeed reads without checking them (a string where a
number belongs fails mid-update as a TypeError); pydantic-validated sections are checked by
DeepSpeed itself at initialisation."""


def check_ds_types(ds: dict, path: Path) -> None:
    """Every key of :data:`DS_SCALAR_TYPES` present in ``ds`` has its type (a finite number
    where a number belongs); a ConfigError naming the JSON and the key otherwise."""
    for section, types_ in DS_SCALAR_TYPES.items():
        values = ds if not section else ds.get(section, {})
        if not isinstance(values, dict):
            raise ConfigError(
                f"{path}: key {section} must be an object, got {type(values).__name__}"
            )
        for key, tp in types_.items():
            if key not in values:
                continue
            v, name = values[key], f"{section}.{key}" if section else key
            ok = isinstance(v, tp) and not (tp is not bool and isinstance(v, bool))
            if tp is float:
                ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
            if not ok:
                want = {bool: "true or false", int: "an integer", float: "a finite number"}[tp]
                raise ConfigError(f"{path}: key {name} must be {want}, got {quote(v)}")


def allow_fp16_on_cpu_for_tests() -> bool:
    """Apply the :data:`FP16_ON_CPU_ENV` emulation when it is set and the accelerator is the
    CPU; True when it was applied."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if os.environ.get(FP16_ON_CPU_ENV) != "1" or acc.device_name() != "cpu":
        return False
    acc.is_fp16_supported = lambda: True
    acc.supported_dtypes = lambda: [torch.float, torch.bfloat16, torch.float16]
    return True


def check_precision_supported(ds: dict, path: str) -> None:
    """A ConfigError naming the DeepSpeed JSON when it asks for a precision this machine's
    accelerator cannot run (DeepSpeed itself raises 'Type fp16 is not supported on your
    device' from every rank, mid-initialisation), with what to use instead."""
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    device = acc.device_name()
    if ds.get("fp16", {}).get("enabled") and not acc.is_fp16_supported():
        instead = (
            "ds_configs/zero1_bf16.json on a GPU with bf16 (A100, H100)"
            if device != "cpu"
            else "ds_configs/cpu_fp32.json (or ds_configs/zero1_bf16.json) on CPU ranks"
        )
        raise ConfigError(
            f"config key train.deepspeed_config: {path}: fp16.enabled is true, but this "
            f"machine's accelerator ({device}) cannot run fp16; use {instead}"
        )
    if ds.get("bf16", {}).get("enabled") and not acc.is_bf16_supported():
        raise ConfigError(
            f"config key train.deepspeed_config: {path}: bf16.enabled is true, but this "
            f"machine's accelerator ({device}) cannot run bf16 (V100 and older GPUs); use "
            "ds_configs/zero1_fp16.json"
        )


def load_ds_config(cfg: ExperimentConfig, dp: int) -> dict:
    """The DeepSpeed JSON with the keys our YAML owns filled in; conflicts are errors."""
    path = Path(cfg.train.deepspeed_config)
    if not path.is_file() and not path.is_absolute():
        shipped = Path(__file__).resolve().parent.parent / path  # relative to the checkout
        path = shipped if shipped.is_file() else path
    if not path.is_file():
        raise ConfigError(f"config key train.deepspeed_config: {path}: no such file")
    try:
        ds = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ConfigError(f"{path}: invalid JSON: {exc}") from None
    if not isinstance(ds, dict):
        raise ConfigError(f"{path}: top level must be an object")
    for key, owner in YAML_OWNED_DS_KEYS.items():
        if key in ds:
            raise ConfigError(f"{path}: key {key} is owned by the YAML config ({owner}); remove it")
    check_ds_types(ds, path)
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if not 0 <= stage <= 3:
        raise ConfigError(f"{path}: key zero_optimization.stage must be 0, 1, 2 or 3, got {stage}")
    if stage >= 2:
        raise ConfigError(
            f"{path}: zero_optimization.stage={stage}: DeepSpeed pipeline parallelism supports "
            "ZeRO stage 0 or 1 only"
        )
    fp16 = ds.get("fp16", {}).get("enabled", False)
    bf16 = ds.get("bf16", {}).get("enabled", False)
    if fp16 and bf16:
        raise ConfigError(f"{path}: fp16.enabled and bf16.enabled are both true")
    ds["train_micro_batch_size_per_gpu"] = 1  # micro-batches are token-based: 1 "sample" each
    ds["gradient_accumulation_steps"] = cfg.train.micro_batches
    ds["train_batch_size"] = cfg.train.micro_batches * dp
    ds["gradient_clipping"] = cfg.train.clip_grad  # DeepSpeed's default would be 1.0
    ds.setdefault("steps_per_print", 10**9)
    if stage == 1:
        # ZeRO accepts only its listed optimizer types, exactly; ours is a torch.optim.AdamW
        # subclass (it records the fp32 gradient norm), so DeepSpeed would refuse it.
        ds.setdefault("zero_allow_untested_optimizer", True)
    return ds


class AdamW(torch.optim.AdamW):
    """AdamW that records the global gradient norm for logging in fp32 mode (DeepSpeed's
    bf16/fp16 optimizers compute their own) and skips an update whose norm is not finite.

    A skip leaves parameters and moments untouched and sets ``overflow``, which DeepSpeed's
    ``_take_model_step`` reads: the LR scheduler is not stepped and ``was_step_applied()`` is
    False, on every stage (the norm is reduced over all stages, so they agree).
    ``locate_fn`` names the first module with a non-finite gradient, as (stage, name).
    """

    norm_fn = None
    locate_fn = None
    pending_norm: float | None = None
    _global_grad_norm: float | None = None
    overflow = False
    nonfinite_at: tuple[int, str] | None = None

    def step(self, closure=None):
        self.overflow, self.nonfinite_at = False, None
        if self.norm_fn is not None:
            norm = self.pending_norm if self.pending_norm is not None else self.norm_fn()
            self._global_grad_norm, self.pending_norm = norm, None
            if not math.isfinite(norm):
                self.overflow = True
                self.nonfinite_at = self.locate_fn() if self.locate_fn is not None else None
                self.zero_grad(set_to_none=True)
                return None
        return super().step(closure)


def first_nonfinite_grad(module: torch.nn.Module, names: dict[int, str]) -> tuple[int, str] | None:
    """(layer-list index, flat module name) of this stage's first parameter whose gradient
    has a non-finite value, in layer order; None when all are finite."""
    found = []
    for key, p in module.named_parameters():
        if p.grad is None or bool(torch.isfinite(p.grad).all()):
            continue
        if key.startswith("tied_modules.embed."):
            found.append((0, "embedding"))
        else:
            idx, local = key.split(".", 1)
            found.append((int(idx), pipe_to_flat_key(names[int(idx)], local).rsplit(".", 1)[0]))
    return min(found) if found else None


def parse_faults(spec: str) -> dict:
    """The fault items of :data:`FAULT_ENV` (see there); unknown items are errors."""
    faults: dict = {}
    for item in filter(None, (x.strip() for x in spec.split(","))):
        kind, _, rest = item.partition("@")
        fields = rest.split(":")
        if kind in ("nan_loss", "inf_grad"):
            at, _, times = fields[0].partition("x")
            entry = {"step": int(at), "times": int(times or 1), "stage": None}
            for f in fields[1:]:
                entry["stage"] = int(f.removeprefix("stage"))
            faults[kind] = entry
        elif kind == "save_exit" and fields[0] in SAVE_POINTS:
            entry = {"point": fields[0], "rank": 0, "step": None}
            for f in fields[1:]:
                key = "rank" if f.startswith("rank") else "step"
                entry[key] = int(f.removeprefix(key))
            faults[kind] = entry
        elif kind == "slow":
            faults[kind] = float(rest)
        elif kind == "enospc" and fields[0] in ("engine", "manifest", "metrics"):
            entry = {"phase": fields[0], "rank": 0}
            for f in fields[1:]:
                entry["rank"] = int(f.removeprefix("rank"))
            faults[kind] = entry
        else:
            raise ConfigError(f"{FAULT_ENV}: cannot parse {item!r}")
    return faults


def pipeline_grad_norm(module: torch.nn.Module, group) -> float:
    """L2 norm of all gradients over every pipeline stage, a tied weight counted once."""
    sq = torch.zeros(1, dtype=torch.float64)
    for p in module.parameters():
        if p.grad is not None and not getattr(p, "ds_pipe_replicated", False):
            sq += p.grad.detach().double().pow(2).sum().cpu()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(sq, group=group)
    return float(sq.sqrt())


# --------------------------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------------------------


def resolve_vocab(cfg: ExperimentConfig) -> ExperimentConfig:
    """model.vocab_size from the data manifest when unset; a mismatch is an error."""
    if cfg.data.dataset == "synthetic":
        if cfg.model.vocab_size is None:
            raise ConfigError("config key model.vocab_size: required with data.dataset=synthetic")
        return cfg
    from megatron_branchnorm.data import open_manifest

    manifest = open_manifest(cfg.data.dataset)
    vocab = int(manifest["vocab_size"])
    if cfg.model.vocab_size is not None and cfg.model.vocab_size != vocab:
        raise ConfigError(
            f"config key model.vocab_size: {cfg.model.vocab_size} differs from the data "
            f"manifest's vocab_size={vocab} ({cfg.data.dataset}/manifest.json)"
        )
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=vocab))


SPM_IN_CHECKPOINT = "spm.model"
"""The training SentencePiece model's copy in every checkpoint tag directory."""


def vocab_identity(cfg: ExperimentConfig) -> tuple[dict | None, str | None]:
    """(``{"spm_sha256", "vocab_size", "path"}`` of the run's SentencePiece model, sha256 of
    the data manifest); (None, None) for synthetic data. The model must be a plain file name
    inside DATA_DIR (a manifest cannot point at any file of the machine)."""
    if cfg.data.dataset == "synthetic":
        return None, None
    from megatron_branchnorm.data import open_manifest

    data_dir = Path(cfg.data.dataset)
    manifest = open_manifest(data_dir)
    name = manifest["spm_model"]
    if Path(name).name != name or name in ("", ".", ".."):
        raise ConfigError(
            f"{data_dir / 'manifest.json'}: key spm_model must be a file name inside the data "
            f"directory, got {name!r}"
        )
    path = data_dir / name
    vocab = {
        "spm_sha256": ckpt.sha256_file(path),
        "vocab_size": int(manifest["vocab_size"]),
        "path": str(path),
    }
    return vocab, ckpt.sha256_file(data_dir / "manifest.json")


def check_writable(save_dir: Path) -> None:
    """Create ``save_dir`` and write a probe file there; a one-line error naming the key
    otherwise (a file in the way, a read-only or full file system, permissions)."""
    try:
        save_dir.mkdir(parents=True, exist_ok=True)
        probe = f".write-probe-{socket.gethostname()}-{os.getpid()}-"
        with tempfile.NamedTemporaryFile(dir=save_dir, prefix=probe) as fh:
            fh.write(b"x")
            fh.flush()
    except OSError as exc:
        raise ConfigError(
            f"config key train.save_dir: cannot write there: {describe_os_error(exc)}"
        ) from None


def precision_of(ds_config: dict) -> str:
    """``fp32`` / ``bf16`` / ``fp16`` with the ZeRO stage: what DeepSpeed's optimizer state
    depends on."""
    kind = "fp32"
    for name in ("bf16", "fp16"):
        if ds_config.get(name, {}).get("enabled"):
            kind = name
    return f"{kind}, ZeRO-{ds_config.get('zero_optimization', {}).get('stage', 0)}"


def build_batches(cfg: ExperimentConfig, split: str, shuffle: bool):
    """A batch iterator with state_dict()/load_state_dict() over the configured dataset."""
    d = cfg.data
    if d.dataset == "synthetic":
        from megatron_branchnorm.synthetic import SyntheticBatches, SyntheticData

        size = d.synthetic_size if split == "train" else max(64, d.synthetic_size // 50)
        data = SyntheticData(size, cfg.model.vocab_size, d.max_length, split)
        return SyntheticBatches(data, d.max_tokens, cfg.train.seed, shuffle=shuffle)
    from megatron_branchnorm.data import BatchSampler, TranslationData

    split = {"valid": "dev"}.get(split, split)  # preprocess_data.py names it dev
    data = TranslationData(d.dataset, split=split, max_length=d.max_length)
    return BatchSampler(data, d.max_tokens, d.sampling_temperature, cfg.train.seed, shuffle=shuffle)


def _src_tokens(batch: dict) -> int:
    if "src_ntokens" in batch:
        return int(batch["src_ntokens"])
    return int((batch["src_tokens"] != PAD_ID).sum())


# --------------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------------


def release_shm_workspace(rank: int) -> None:
    """Unlink this rank's name of DeepSpeed's CPU shared-memory all-reduce workspace.

    On the CPU accelerator, ``init_distributed`` builds ``deepspeed_shm_comm``, whose
    ``shm_initialize`` creates ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``
    (66 MB) and maps every peer's segment, but never unlinks the names: every launch leaves
    66 MB per rank in /dev/shm (RAM), even on a clean exit (15 GB after a day of tests here).
    Once all ranks are past ``init_distributed`` (the barrier) every peer has mapped this
    segment, so the name can go: the mappings stay valid until each process exits, and nothing
    is left behind, not even after a kill -9.
    """
    dist.barrier()
    env = os.environ
    name = (
        f"deepspeed_allreduce_buffer_{os.getuid()}_{env.get('MASTER_ADDR', '')}"
        f"_{env.get('MASTER_PORT', '')}_{rank}"
    )
    with contextlib.suppress(FileNotFoundError):
        os.unlink(Path("/dev/shm") / name)


class Trainer:
    """Builds the stage of this rank, resumes if ``save_dir`` has a checkpoint, trains."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        stop_signals.install()  # train.py installs it first thing; a Trainer built in-process too
        setup_process_env()
        self.threads = set_thread_count()
        self.world = int(os.environ["WORLD_SIZE"])
        stages = cfg.pipeline.stages
        if self.world % stages:
            raise ConfigError(
                f"config key pipeline.stages: {stages} does not divide the world size {self.world}"
            )
        self.dp = self.world // stages
        cfg = resolve_vocab(cfg)
        self.cfg = cfg
        self.ds_config = load_ds_config(cfg, self.dp)
        allow_fp16_on_cpu_for_tests()
        check_precision_supported(self.ds_config, cfg.train.deepspeed_config)
        self.parts = partition_plan(cfg.model, stages, cfg.pipeline.partition)
        self.save_dir = Path(cfg.train.save_dir)
        self.faults = parse_faults(os.environ.get(FAULT_ENV, ""))
        self.injected: dict[str, int] = {}
        self._pending_inf = False
        self.vocab, self.data_manifest_sha256 = vocab_identity(cfg)
        check_writable(self.save_dir)  # every rank, before any collective: all fail alike

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        timeout = datetime.timedelta(seconds=cfg.train.collective_timeout_s)
        deepspeed.init_distributed(dist_backend=backend, timeout=timeout)
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        if backend == "gloo":
            release_shm_workspace(self.rank)
        self.lock: RunLock | None = None
        self._take_lock()
        try:
            self._build(cfg)
        except BaseException:
            self.close()
            raise

    def _take_lock(self) -> None:
        """Rank 0 takes ``SAVE_DIR/run.lock`` (module run_lock); every rank learns the
        outcome, so a refused start exits 2 on every rank with the same line."""
        error = None
        if self.rank == 0:
            lock = RunLock(self.save_dir)
            try:
                lock.acquire()
                self.lock = lock
                for warning in lock.warnings:
                    print(f"warning: {warning}", flush=True)
            except (LockError, OSError) as exc:
                error = str(exc) if isinstance(exc, LockError) else describe_os_error(exc)
        self.agree_or_raise(error)

    def agree_or_raise(self, error: str | None) -> None:
        """Collective: raise :class:`TrainError` on every rank when any rank has an error
        (each rank passes its own, or None), with the first failing rank's message."""
        errors = [error]
        if self.world > 1:
            errors = [None] * self.world
            dist.all_gather_object(errors, error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            rank, msg = failed[0]
            where = f" (rank {rank})" if self.world > 1 else ""
            raise TrainError(f"{msg}{where}")

    def close(self) -> None:
        """Release the save_dir's lock (rank 0) and the TensorBoard writer."""
        if getattr(self, "tb", None):
            self.tb.close()
            self.tb = None
        if getattr(self, "lock", None) is not None:
            self.lock.release()
            self.lock = None

    def _build(self, cfg: ExperimentConfig) -> None:
        """The stage's module, DeepSpeed's engine, the data: everything after the lock."""
        torch.manual_seed(cfg.train.seed + self.rank)
        self.loss_fn = PipeLoss(cfg.train.label_smoothing)
        module = build_pipeline_module(
            cfg.model,
            self.parts,
            cfg.train.seed,
            self.loss_fn,
            cfg.pipeline.activation_checkpoint_interval,
        )
        self.fp32 = not (
            self.ds_config.get("fp16", {}).get("enabled")
            or self.ds_config.get("bf16", {}).get("enabled")
        )
        t = cfg.train
        optimizer = AdamW(
            [p for p in module.parameters() if p.requires_grad],
            lr=t.lr,
            betas=(t.adam_beta1, t.adam_beta2),
            eps=t.adam_eps,
            weight_decay=t.weight_decay,
            fused=True,  # one kernel per parameter, CPU or CUDA (7x the for-loop: docs/performance.md)
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, inverse_sqrt_factor(cfg))
        try:
            self.engine, _, _, _ = deepspeed.initialize(
                model=module, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config
            )
        except (ValueError, TypeError, KeyError) as exc:  # pydantic's ValidationError included
            raise ConfigError(
                f"config key train.deepspeed_config: {cfg.train.deepspeed_config}: DeepSpeed "
                f"rejects it: {one_line(str(exc), 300)}"
            ) from None
        install_engine_fixes(self.engine)
        self.module = module
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.stage_id = self.engine.stage_id
        self.dp_id = self.engine.grid.data_parallel_id
        if self.fp32:
            self._install_fp32_grad_norm()
        self.train_batches = build_batches(cfg, "train", shuffle=True)
        self.train_iter = iter(self.train_batches)
        self.step = 0
        self.samples = 0
        self.skipped = 0
        self.ids_hash = ""
        self.is_logger = self.rank == 0
        self.tb = None
        self.local_error: str | None = None  # an error of this rank only, agreed on each update
        self.save_error: str | None = None  # this rank's part of the save in progress failed
        self.resumed_from: str | None = None
        self.config_changes: dict[str, list] = {}
        self._valid: list[dict] | None = None

    # ---- grad norm in fp32 mode --------------------------------------------------------------

    def _install_fp32_grad_norm(self) -> None:
        group = self.engine.grid.get_model_parallel_group()  # all stages of one replica
        module, opt, engine = self.module, self.optimizer, self.engine
        names = spec_names(self.cfg.model)

        def norm_fn() -> float:
            self._maybe_inject_inf_grad()
            return pipeline_grad_norm(module, group)

        def locate() -> tuple[int, str] | None:
            mine = first_nonfinite_grad(module, names)
            found = [None] * dist.get_world_size(group)
            dist.all_gather_object(found, mine and (mine[0], mine[1], self.stage_id), group=group)
            found = [f for f in found if f is not None]
            return (min(found)[2], min(found)[1]) if found else None

        opt.norm_fn, opt.locate_fn = norm_fn, locate

        def clip() -> None:
            # DeepSpeed's own fp32 clip counts only stage 0's gradients in a pipeline.
            norm = norm_fn()
            opt.pending_norm = norm
            coef = engine.gradient_clipping() / (norm + 1e-6)
            if coef < 1.0 and math.isfinite(norm):
                for p in module.parameters():
                    if p.grad is not None:
                        p.grad.detach().mul_(coef)

        engine.clip_fp32_gradients = clip

    # ---- test-only fault injection (FAULT_ENV) -------------------------------------------------

    def _fault_due(self, kind: str) -> bool:
        """Whether fault ``kind`` fires for the update in progress (t = step + 1)."""
        f = self.faults.get(kind)
        if f is None or f["step"] != self.step + 1 or self.injected.get(kind, 0) >= f["times"]:
            return False
        self.injected[kind] = self.injected.get(kind, 0) + 1
        return True

    def _maybe_inject_inf_grad(self) -> None:
        f = self.faults.get("inf_grad")
        if f is None or not self._pending_inf:
            return
        self._pending_inf = False
        stage = self.engine.num_stages - 1 if f["stage"] is None else f["stage"]
        if self.stage_id == stage:
            # not a replicated tied copy: the norm counts the tied weight on its first stage
            p = next(
                p
                for p in self.module.parameters()
                if p.grad is not None and not getattr(p, "ds_pipe_replicated", False)
            )
            p.grad.view(-1)[0] = float("inf")

    def _maybe_exit_in_save(self, point: str) -> None:
        f = self.faults.get("save_exit")
        if f is None or f["point"] != point or f["rank"] != self.rank:
            return
        if f["step"] is None or f["step"] == self.step:
            print(
                f"fault injection: exiting at {point} of the save at step {self.step}", flush=True
            )
            os._exit(FAULT_EXIT_CODE)

    # ---- logging -----------------------------------------------------------------------------

    def log(self, msg: str) -> None:
        if self.is_logger:
            print(msg, flush=True)

    def _write_metrics(self, record: dict) -> None:
        if not self.is_logger or self.local_error is not None:
            return
        try:
            f = self.faults.get("enospc")
            if f is not None and f["phase"] == "metrics" and f["rank"] == self.rank:
                raise OSError(errno.ENOSPC, "fault injection", str(self.save_dir / "metrics.jsonl"))
            with open(self.save_dir / "metrics.jsonl", "a", encoding="utf-8") as fh:
                fh.write(json.dumps(record) + "\n")
        except OSError as exc:
            # Only this rank knows: the others learn it at the next agreement (_agree_to_stop)
            # and all ranks stop with this line instead of waiting for this one in a collective.
            self.local_error = f"cannot write metrics: {describe_os_error(exc)}"
            return
        if self.tb is None:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(self.save_dir / "tensorboard"))
            except Exception as exc:  # noqa: BLE001 - logging must not stop training
                self.log(f"tensorboard disabled: {exc}")
                self.tb = False
        if self.tb:
            try:
                for key, value in record.items():
                    if isinstance(value, (int, float)) and key != "step":
                        self.tb.add_scalar(key, value, record["step"])
                self.tb.flush()
            except Exception as exc:  # noqa: BLE001 - TensorBoard must not stop training
                self.log(f"tensorboard disabled: {one_line(str(exc), 300)}")
                self.tb = False

    # ---- data for one update -----------------------------------------------------------------

    def _next_update(self) -> tuple[list[dict], int, int]:
        """This rank's micro-batches of the next update, plus the global target and
        source+target token counts."""
        gas = self.cfg.train.micro_batches
        batches = [next(self.train_iter) for _ in range(gas * self.dp)]
        ntokens = sum(int(b["ntokens"]) for b in batches)
        all_tokens = ntokens + sum(_src_tokens(b) for b in batches)
        self.samples += sum(int(b["src_tokens"].shape[0]) for b in batches)
        ids = torch.cat([b["ids"].reshape(-1).long() for b in batches if "ids" in b] or [])
        self.ids_hash = hashlib.sha256(ids.numpy().tobytes()).hexdigest()[:16] if len(ids) else ""
        mine = batches[self.dp_id * gas : (self.dp_id + 1) * gas]
        return mine, ntokens, all_tokens

    def _as_engine_items(self, batches: list[dict]):
        device = self.engine.device
        for b in batches:
            yield (
                (b["src_tokens"].to(device), b["prev_output_tokens"].to(device)),
                b["target"].to(device),
            )

    def _reduce_loss_sums(self) -> tuple[float, float, int]:
        sums = torch.tensor(
            [self.loss_fn.loss_sum, self.loss_fn.nll_sum, float(self.loss_fn.ntokens)],
            dtype=torch.float64,
        )
        if self.world > 1:
            dist.all_reduce(sums)  # only last-stage ranks hold non-zero sums
        self.loss_fn.reset()
        return float(sums[0]), float(sums[1]), int(sums[2])

    # ---- validation --------------------------------------------------------------------------

    def _load_valid(self, max_batches: int) -> list[dict]:
        """Up to ``max_batches`` validation batches, a multiple of the data-parallel size."""
        try:
            valid = build_batches(self.cfg, "valid", shuffle=False)
        except Exception as exc:  # noqa: BLE001 - a dataset without valid split
            self.log(f"validation skipped: {exc}")
            return []
        batches = []
        for b in valid:
            batches.append(b)
            if len(batches) >= max_batches:
                break
        return batches[: (len(batches) // self.dp) * self.dp]

    def validate(self, max_batches: int = 64) -> float | None:
        """Per-token validation loss (label-smoothed, as trained) on the valid split."""
        if self._valid is None:  # opened and collated once, reused at every evaluation
            self._valid = self._load_valid(max_batches)
        if not self._valid:
            return None
        batches = self._valid
        per_rank = len(batches) // self.dp
        ntokens = sum(int(b["ntokens"]) for b in batches)
        mine = batches[self.dp_id * per_rank : (self.dp_id + 1) * per_rank]
        self.loss_fn.reset()
        self.loss_fn.scale = per_rank * self.dp / ntokens
        self.engine.eval_batch(iter(list(self._as_engine_items(mine))), num_micro_batches=per_rank)
        loss_sum, _, count = self._reduce_loss_sums()
        return loss_sum / max(count, 1)

    # ---- checkpoints -------------------------------------------------------------------------

    def save(self) -> None:
        """Checkpoint at the current step; ``latest`` moves only once it is complete.

        A rank whose part of the save fails (a full disk, a quota) does not leave the others
        waiting in a barrier: the failure is agreed on (:meth:`agree_or_raise`) and every rank
        raises the same one-line :class:`TrainError`. The tag then has no manifest, so it is
        never loaded, and ``latest`` still names the last complete checkpoint.
        """
        tag = ckpt.tag_for(self.step)
        tag_dir = self.save_dir / tag
        client = {
            "step": self.step,
            "samples": self.samples,
            "sampler": self.train_batches.state_dict(),
            "spec_names": spec_names(self.cfg.model),
            "parts": self.parts,
            "config": self.cfg.to_dict(),
            "vocab": None
            if self.vocab is None
            else {k: self.vocab[k] for k in ("spm_sha256", "vocab_size")},
            "data_manifest_sha256": self.data_manifest_sha256,
            "precision": precision_of(self.ds_config),
        }
        t0 = time.time()
        if self.rank == 0 and tag_dir.is_dir() and not (tag_dir / ckpt.MANIFEST).is_file():
            shutil.rmtree(tag_dir)  # leftovers of a save that was killed: start clean
        dist.barrier()
        self._guard_checkpoint_engine()
        self.save_error = None
        self.engine.save_checkpoint(
            str(self.save_dir), tag=tag, client_state=client, save_latest=False
        )
        self._maybe_exit_in_save("after_engine")
        if self.save_error is None:
            try:
                torch.save(ckpt.rng_state(), ckpt.rng_file(tag_dir, self.rank))
            except (OSError, RuntimeError) as exc:
                self.save_error = self._describe_save_failure(
                    exc, ckpt.rng_file(tag_dir, self.rank)
                )
        self._maybe_exit_in_save("after_rng")
        self.agree_or_raise(self.save_error)
        error = None
        if self.rank == 0:
            try:
                self._maybe_fail_in_save("manifest")
                if self.vocab is not None:
                    shutil.copyfile(self.vocab["path"], tag_dir / SPM_IN_CHECKPOINT)
                (tag_dir / "train_config.json").write_text(
                    json.dumps(client, indent=1, sort_keys=True, default=str), encoding="utf-8"
                )
                self._maybe_exit_in_save("after_config")
                ckpt.write_manifest(tag_dir, self.step)
                self._maybe_exit_in_save("after_manifest")
                ckpt.write_latest(self.save_dir, tag)
            except OSError as exc:
                error = f"checkpoint {tag_dir} not saved: {describe_os_error(exc)}"
        self.agree_or_raise(error)
        self.log(f"saved checkpoint {tag_dir} in {time.time() - t0:.1f}s")
        self._retain()

    def _retain(self) -> None:
        """Checkpoint retention after a complete save (rank 0; every rank has finished
        writing: the save ends in a collective). A failure to delete is a warning: the run
        goes on, the next save tries again."""
        t = self.cfg.train
        if self.rank != 0 or not (t.keep_last or t.keep_best):
            return
        try:
            _, line = retention.apply_retention(self.save_dir, t.keep_last, t.keep_best)
        except OSError as exc:
            line = f"warning: checkpoint retention failed: {describe_os_error(exc)}"
        self.log(line)

    def _describe_save_failure(self, exc: BaseException, path) -> str:
        """One line for a failed checkpoint file: torch.save reports a full disk as a
        RuntimeError from its zip writer ("unexpected pos ..."), so the free space is said."""
        tag_dir = self.save_dir / ckpt.tag_for(self.step)
        if isinstance(exc, OSError):
            return f"checkpoint {tag_dir} not saved: {describe_os_error(exc)}"
        try:
            free = shutil.disk_usage(self.save_dir).free
        except OSError:
            free = None
        why = one_line(str(exc), 200)
        if free is not None and free < 1 << 20:
            why = f"no space left on device ({free:,} bytes free; torch: {why})"
        return f"checkpoint {tag_dir} not saved: {path}: write failed: {why}"

    def _maybe_fail_in_save(self, phase: str) -> None:
        """Test-only (``enospc@PHASE[:rankR]`` in FAULT_ENV): a full disk in this phase."""
        f = self.faults.get("enospc")
        if f is not None and f["phase"] == phase and f["rank"] == self.rank:
            path = self.save_dir / ckpt.tag_for(self.step)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    def _guard_checkpoint_engine(self) -> None:
        """Wrap DeepSpeed's checkpoint engine's ``save`` (every file DeepSpeed writes): an
        OSError (a full disk) is recorded in :attr:`save_error` instead of raised, and the
        rank's remaining files are skipped, so DeepSpeed's own collectives in
        ``save_checkpoint`` (tag validation, its final barrier) still match across ranks and
        the failure is agreed on afterwards. Also the test-only faults ``save_exit@engine_file``
        and ``enospc@engine``."""
        engine = self.engine.checkpoint_engine
        if getattr(engine, "_mbn_guarded", False):
            return
        save = engine.save

        def guarded_save(*args, **kwargs):
            if self.save_error is not None:
                return None
            try:
                self._maybe_fail_in_save("engine")
                out = save(*args, **kwargs)
            except (OSError, RuntimeError) as exc:  # torch.save: RuntimeError on a full disk
                path = kwargs.get("path", args[1] if len(args) > 1 else None)
                self.save_error = self._describe_save_failure(exc, path)
                return None
            self._maybe_exit_in_save("engine_file")
            return out

        engine.save, engine._mbn_guarded = guarded_save, True

    def maybe_resume(self) -> None:
        """Resume from the newest complete checkpoint (``latest``, or a complete one newer than
        it), verified against its checksums; an unreadable ``latest`` is an error."""
        tag, notes = ckpt.resume_tag(self.save_dir)
        for note in notes:
            self.log(f"warning: {note}")
        if tag is None:
            return
        tag_dir = self.save_dir / tag
        ckpt.verify_checkpoint(tag_dir)
        saved = json.loads((tag_dir / "train_config.json").read_text(encoding="utf-8"))
        self.resumed_from = tag
        self.config_changes = self._check_resume_config(tag_dir, saved)
        if saved["parts"] != self.parts or saved.get("repartitioned"):
            self._resume_other_layout(tag_dir, saved)
            return
        old_precision = saved.get("precision")
        if old_precision is not None and old_precision != precision_of(self.ds_config):
            raise ConfigError(
                f"config key train.deepspeed_config: {self.cfg.train.deepspeed_config} trains in "
                f"{precision_of(self.ds_config)}, the checkpoint {tag_dir} in {old_precision}: "
                "DeepSpeed's optimizer state differs between them; use a DeepSpeed JSON with the "
                "checkpoint's precision and ZeRO stage"
            )
        load_path, client = self.engine.load_checkpoint(str(self.save_dir), tag=tag)
        if load_path is None:
            raise ckpt.CheckpointError(f"{tag_dir}: DeepSpeed could not load the checkpoint")
        self.step = int(client["step"])
        self.samples = int(client["samples"])
        self.train_batches.load_state_dict(client["sampler"])
        self.train_iter = iter(self.train_batches)
        rng_path = ckpt.rng_file(tag_dir, self.rank)
        if rng_path.is_file():
            ckpt.set_rng_state(torch.load(rng_path, weights_only=True))
        else:
            self.log(f"warning: {rng_path} missing (different world size): RNG not restored")
        if self.scheduler.last_epoch != self.step:
            raise ckpt.CheckpointError(
                f"{tag_dir}: LR scheduler at {self.scheduler.last_epoch}, step {self.step}"
            )
        self._apply_optimizer_config()
        self.log(f"resumed from {tag_dir} at step {self.step}")

    def _check_resume_config(self, tag_dir: Path, saved: dict) -> dict:
        """The checks a resume makes against the checkpoint: first the vocabulary (the data's
        SentencePiece model must be the one the checkpoint was trained with: its sha256 in
        ``train_config.json``), then the config, key by key (module resume_policy: a fixed
        key that differs is an error). Returns the allowed changes."""
        if "vocab" not in saved:
            self.log(
                f"warning: {tag_dir} predates vocabulary checks: the SentencePiece model of "
                f"{self.cfg.data.dataset} cannot be checked against it"
            )
        else:
            old = (saved["vocab"] or {}).get("spm_sha256")
            new = (self.vocab or {}).get("spm_sha256")
            if old != new:
                mine = self.vocab["path"] if self.vocab else "synthetic data (no vocabulary)"
                theirs = f"{tag_dir / SPM_IN_CHECKPOINT}" if old else "synthetic data"
                raise ConfigError(
                    f"config key data.dataset: {mine} is not the vocabulary the checkpoint was "
                    f"trained with ({theirs}; sha256 {str(old)[:12]} vs {str(new)[:12]}); "
                    "resume with the checkpoint's data or use a new train.save_dir"
                )
        same_data = (
            self.data_manifest_sha256 is not None
            and saved.get("data_manifest_sha256") == self.data_manifest_sha256
        )
        try:
            return resume_policy.check_resume(
                saved["config"], self.cfg.to_dict(), str(tag_dir), same_data
            )
        except resume_policy.ResumeConfigError as exc:
            raise ConfigError(str(exc)) from None

    def _apply_optimizer_config(self) -> None:
        """This run's learning rate and Adam settings over the restored optimizer and
        scheduler state (which carry the values of the run that saved them): the keys that
        resume_policy lets change take effect."""
        t = self.cfg.train
        factor = inverse_sqrt_factor(self.cfg)
        self.scheduler.base_lrs = [t.lr for _ in self.scheduler.base_lrs]
        self.scheduler.lr_lambdas = [factor for _ in self.scheduler.base_lrs]
        for group in self.optimizer.param_groups:
            group["initial_lr"] = t.lr
            group["lr"] = t.lr * factor(self.step)
            group["betas"] = (t.adam_beta1, t.adam_beta2)
            group["eps"] = t.adam_eps
            group["weight_decay"] = t.weight_decay
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _resume_other_layout(self, tag_dir: Path, saved: dict) -> None:
        """Resume a checkpoint written with another stage layout: weights layer by layer
        (layer files are named by their index in the layer list, not by stage), step, data
        position; the optimizer state starts fresh (a warning says so) and the LR schedule
        continues from the step."""
        from megatron_branchnorm.inference.convert import read_checkpoint

        # Only this stage's layer files, and entry 0 (the tied embedding is saved there): a
        # rank of a 1000-layer model must not load the whole model to keep 1/16 of it.
        mine = set(range(self.parts[self.stage_id], self.parts[self.stage_id + 1])) | {0}
        _, flat = read_checkpoint(tag_dir, verify=False, indices=mine)  # maybe_resume verified
        names = spec_names(self.cfg.model)
        state = {}
        for key in self.module.state_dict():
            if key.startswith("tied_modules.embed."):
                flat_key = key.removeprefix("tied_modules.embed.")
            else:
                idx, local = key.split(".", 1)
                flat_key = pipe_to_flat_key(names[int(idx)], local)
            if flat_key not in flat:
                raise ckpt.CheckpointError(f"{tag_dir}: no weights for {flat_key}")
            state[key] = flat[flat_key]
        self.module.load_state_dict(state, strict=True)
        self.step = int(saved["step"])
        self.samples = int(saved["samples"])
        self.train_batches.load_state_dict(saved["sampler"])
        self.train_iter = iter(self.train_batches)
        self.scheduler.last_epoch = self.step
        self._apply_optimizer_config()
        self.log(
            f"warning: {tag_dir} was written with stage layout {saved['parts']}, this run uses "
            f"{self.parts}: weights loaded layer by layer at step {self.step}; optimizer state "
            "(Adam moments) and RNG states start fresh"
        )

    # ---- main loop ---------------------------------------------------------------------------

    def _agree_to_stop(self, time_up: bool) -> tuple[bool, bool]:
        """(a stop signal reached some rank, the time budget is spent), agreed by all ranks;
        a rank's own error (:attr:`local_error`) makes every rank raise it."""
        flags = torch.tensor(
            [
                float(stop_signals.received() != 0),
                float(time_up),
                float(self.local_error is not None),
            ]
        )
        if self.world > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        if flags[2]:
            self.agree_or_raise(self.local_error)
        return bool(flags[0]), bool(flags[1])

    def train(self) -> int:
        """Run to train.max_steps (or the time budget, or a signal); returns the exit code.
        The save_dir's lock is released however it ends."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> int:
        cfg = self.cfg
        self.maybe_resume()
        error = None
        if self.rank == 0:
            for key, (old, new) in self.config_changes.items():
                self.log(f"config key {key} changed on resume: {old!r} -> {new!r}")
            error = None
            try:
                dump_config(cfg, self.save_dir / "config.yaml")
                resume_policy.append_history(
                    self.save_dir, self.step, self.resumed_from, self.config_changes
                )
            except OSError as exc:
                error = f"cannot write the run's config: {describe_os_error(exc)}"
        self.agree_or_raise(error)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.log(
            f"world {self.world} = {cfg.pipeline.stages} stages x {self.dp} data-parallel; "
            f"{self.threads} threads/rank; {describe_layernorm(cfg.model.layernorm_impl, device_type)}"
        )
        self.log(describe_plan(cfg.model, self.parts))
        start_time = time.time()
        last_log_time, interval_tokens = time.time(), 0
        first_step = self.step
        patience = self._restore_patience()
        exit_code = 0
        consecutive = 0
        if self._agree_to_stop(False)[0]:
            # The signal came while the ranks were starting: no update since the checkpoint
            # we resumed from (or none at all), so there is nothing to save.
            stop_signals.clear()
            self.log(
                f"signal received before the first update (step {self.step}): nothing new to "
                f"save, exiting {REQUEUE_EXIT_CODE}"
            )
            dist.barrier()
            return REQUEUE_EXIT_CODE
        while self.step < cfg.train.max_steps:
            t = self.step + 1
            if "slow" in self.faults:
                time.sleep(self.faults["slow"])
            alpha = set_pipeline_step(self.module, cfg.model, t)
            mine, ntokens, all_tokens = self._next_update()
            self.loss_fn.reset()
            self.loss_fn.scale = cfg.train.micro_batches * self.dp / max(ntokens, 1)
            if self._fault_due("nan_loss"):
                self.loss_fn.scale = float("nan")
            self._pending_inf = self._fault_due("inf_grad")
            lr = self.optimizer.param_groups[0]["lr"]
            self.engine.train_batch(data_iter=self._as_engine_items(mine))
            loss_sum, nll_sum, count = self._reduce_loss_sums()
            applied = self.engine.was_step_applied()
            if applied:
                self.step += 1
                interval_tokens += all_tokens
                consecutive = 0
            else:
                self.skipped += 1
                consecutive += 1
                if self._on_skip(t, consecutive):
                    exit_code = NONFINITE_EXIT_CODE
                    break
            if applied and (
                self.step % cfg.train.log_interval == 0 or self.step == cfg.train.max_steps
            ):
                now = time.time()
                gn = self.engine.get_global_grad_norm()
                nll = nll_sum / max(count, 1)
                record = {
                    "step": self.step,
                    "loss": loss_sum / max(count, 1),
                    "nll_loss": nll,
                    "ppl": math.exp(min(nll, 50.0)),
                    "lr": lr,
                    "grad_norm": None if gn is None else float(gn),
                    "alpha": alpha,
                    "loss_scale": self._loss_scale(),
                    "tokens_per_sec": interval_tokens / max(now - last_log_time, 1e-9),
                    "samples": self.samples,
                    "ids_hash": self.ids_hash,
                    "skipped_steps": self.skipped,
                    "memory_mb": self._memory_mb(),
                    "elapsed_s": now - start_time,
                    "eta_s": self._eta(now - start_time, self.step - first_step),
                }
                self._write_metrics(record)
                self.log(
                    f"step {self.step} | loss {record['loss']:.4f} | nll {nll:.4f} | "
                    f"lr {lr:.3g} | gnorm {record['grad_norm'] or 0:.3f} | alpha {alpha:.4f} | "
                    f"tok/s {record['tokens_per_sec']:.0f} | mem {record['memory_mb']:.0f}MB | "
                    f"eta {format_eta(record['eta_s'])}"
                )
                last_log_time, interval_tokens = now, 0
            if applied and cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0:
                vloss = self.validate()
                if vloss is not None:
                    self._write_metrics({"step": self.step, "valid_loss": vloss})
                    self.log(f"step {self.step} | valid loss {vloss:.4f}")
                    if patience.update(self.step, vloss):  # the same value on every rank
                        self.save()
                        self._write_metrics(
                            {"step": self.step, "early_stop": True, "best_valid_loss": patience.best,
                             "best_step": patience.best_step}
                        )  # fmt: skip
                        self.log(f"early stop at step {self.step}: {patience.describe()}")
                        break
            budget = cfg.train.max_time_minutes
            time_up = bool(budget) and (time.time() - start_time) >= budget * 60
            stop_now, time_up = self._agree_to_stop(time_up)
            if stop_now or time_up:
                self.save()
                if stop_now:
                    stop_signals.clear()
                    self.log(f"signal received: checkpoint saved, exiting {REQUEUE_EXIT_CODE}")
                    exit_code = REQUEUE_EXIT_CODE
                else:
                    self.log(f"time budget of {budget} min reached at step {self.step}")
                break
            if applied and cfg.train.save_interval and self.step % cfg.train.save_interval == 0:
                self.save()
        else:
            if not (self.save_dir / ckpt.tag_for(self.step) / ckpt.MANIFEST).is_file():
                self.save()
        dist.barrier()
        return exit_code

    def _restore_patience(self) -> Patience:
        """Early stopping's state at the resumed step, from rank 0's read of metrics.jsonl
        (broadcast: every rank must take the same decision); nothing is read when it is off
        or the run starts fresh."""
        patience = Patience(self.cfg.train.patience)
        if not patience.patience or not self.step:
            return patience
        losses = [retention.valid_losses(self.save_dir) if self.rank == 0 else None]
        if self.world > 1:
            dist.broadcast_object_list(losses, src=0)
        patience.restore(losses[0], self.step)
        return patience

    def _eta(self, elapsed: float, updates: int) -> float:
        """Seconds to the end of training at this process's mean time per update: to
        train.max_steps, or to the end of train.max_time_minutes when that comes first."""
        left = (self.cfg.train.max_steps - self.step) * elapsed / max(updates, 1)
        budget = self.cfg.train.max_time_minutes
        return min(left, budget * 60 - elapsed) if budget else left

    def _on_skip(self, t: int, consecutive: int) -> bool:
        """Log a skipped update (metrics record and console); True when the run must stop."""
        where = getattr(self.optimizer, "nonfinite_at", None) if self.fp32 else None
        stage, module = where if where else (None, None)
        self._write_metrics(
            {
                "step": self.step,
                "skipped": True,
                "update": t,
                "consecutive_skips": consecutive,
                "skipped_steps": self.skipped,
                "first_nonfinite_stage": stage,
                "first_nonfinite_module": module,
                "loss_scale": self._loss_scale(),  # after the skip: fp16 lowered it
                "ids_hash": self.ids_hash,
            }
        )
        what = f"first non-finite gradient in {module} (stage {stage})" if where else "overflow"
        self.log(
            f"update {t} skipped at step {self.step}: non-finite gradient norm; {what}; "
            f"{consecutive} consecutive, {self.skipped} in total"
        )
        limit = self.cfg.train.max_consecutive_skips
        if not self.fp32 or consecutive < limit:
            return False  # fp16: DeepSpeed's loss scaler lowers the scale and retries
        latest = ckpt.read_latest(self.save_dir)
        msg = (
            f"error: stopping: {consecutive} consecutive updates with a non-finite gradient norm "
            f"(train.max_consecutive_skips={limit}) at step {self.step}; {what}; the last good "
            f"checkpoint is {self.save_dir / latest if latest else 'none'}"
        )
        if self.is_logger:
            print(msg, file=sys.stderr, flush=True)
        return True

    def _loss_scale(self) -> float:
        """fp16's dynamic loss scale (DeepSpeed's optimizer); 1.0 in fp32 and bf16."""
        return 1.0 if self.fp32 else float(getattr(self.engine.optimizer, "cur_scale", 1.0))

    @staticmethod
    def _memory_mb() -> float:
        if torch.cuda.is_available():
            return torch.cuda.max_memory_allocated() / 2**20
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def run(cfg: ExperimentConfig) -> int:
    """Train with ``cfg``; returns the process exit code.

    The process group is destroyed when the ranks end together (done, stopped by a signal, or
    an error they agreed on): left to the interpreter's exit, gloo's worker threads are torn
    down after Python and a rank sometimes aborts with "terminate called without an active
    exception" (SIGABRT: exit 0 or 75 became -6; seen in the demo test, pytorch#190489).
    After an error of one rank alone the others may still be in a collective, so it is left.
    """
    try:
        code = Trainer(cfg).train()
    except TrainError:
        _destroy_process_group()
        raise
    _destroy_process_group()
    sys.stdout.flush()
    return code


def _destroy_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
