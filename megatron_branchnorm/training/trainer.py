"""The training loop on DeepSpeed's pipeline engine (docs/design.md §1).

One code path for every topology: a single process is a 1-stage pipeline. Each update:

1. every rank draws the update's ``micro_batches x dp`` micro-batches from one global,
   seed-determined stream and keeps its data-parallel share; the global target-token count N
   is known to all ranks;
2. every stage sets BranchNorm's alpha_t for t = applied updates + 1 (a Python float);
3. ``engine.train_batch()``; the loss is normalised per target token of the whole update;
4. the parts that are due: the metrics row, validation (and early stopping), the collective
   stop check (a signal: save, exit REQUEUE_EXIT_CODE; the time budget: save, exit 0), the
   periodic checkpoint.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

import deepspeed
import torch

from megatron_branchnorm.config import ConfigError, ExperimentConfig
from megatron_branchnorm.data.buckets import max_shapes_of
from megatron_branchnorm.data.sampling import (
    SAMPLING_FILE,
    format_sampling_table,
    sampling_table,
    write_sampling_table,
)
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.formats.outputs import describe_os_error
from megatron_branchnorm.model.residual import describe_layernorm, set_branch_scale
from megatron_branchnorm.parallel.partition import describe_plan, partition_plan, spec_names
from megatron_branchnorm.parallel.pipeline import (
    PipeLoss,
    build_pipeline_module,
    fixed_shapes,
    install_engine_fixes,
)
from megatron_branchnorm.parallel.planner import (
    auto_checkpoint_interval,
    stage_plan,
    training_flops,
)
from megatron_branchnorm.training import collectives, cuda_graphs, stop_signals
from megatron_branchnorm.training import ds_config as dsc
from megatron_branchnorm.training import environment as env
from megatron_branchnorm.training.bf16_grads import install_bf16_grad_accumulation
from megatron_branchnorm.training.checkpointer import Checkpointer, check_writable
from megatron_branchnorm.training.data import (
    TrainStream,
    as_engine_items,
    resolve_vocab,
    shape_disagreement,
    vocab_identity,
)
from megatron_branchnorm.training.exit_codes import (
    DONE,
    NONFINITE_EXIT_CODE,
    OUT_OF_MEMORY_EXIT_CODE,
    PEER_LOST_EXIT_CODE,
    REQUEUE_EXIT_CODE,
)
from megatron_branchnorm.training.grad_norm import SkipNonfiniteAdamW, install_fp32_grad_norm
from megatron_branchnorm.training.layout import Device, choose_layout, saved_batch
from megatron_branchnorm.training.lr_schedule import inverse_sqrt_factor
from megatron_branchnorm.training.metrics import MetricsLog, Progress, UpdateFigures
from megatron_branchnorm.training.run_lock import LockError, RunLock
from megatron_branchnorm.training.state import TrainState
from megatron_branchnorm.training.stopping import (
    NonfiniteSkips,
    Stopper,
    TrainError,
    agree_or_raise,
)
from megatron_branchnorm.training.validation import (
    Validator,
    read_loss_sums,
    reduce_loss_sums,
)


@dataclass(frozen=True)
class UpdateResult:
    """What one update did. ``loss_sums`` stay on the device (reduced over the ranks, not
    read): only a logged row reads them (one host sync)."""

    applied: bool  # False: skipped for a non-finite gradient norm
    alpha: float  # BranchNorm's alpha_t of the update
    lr: float  # the learning rate it was taken with
    loss_sums: torch.Tensor  # (loss sum, nll sum, target tokens), see validation.read_loss_sums
    ids_hash: str  # the update's batches (docs/design.md §15)
    tokens: int  # source + target tokens of the update, all ranks


class Trainer:
    """Builds the stage of this rank, resumes if ``save_dir`` has a checkpoint, trains."""

    def __init__(self, cfg: ExperimentConfig) -> None:
        stop_signals.install()  # train.py installs it first thing; a Trainer built in-process too
        env.setup_process_env()
        self.threads = env.set_thread_count()
        world = int(os.environ["WORLD_SIZE"])
        stages = cfg.pipeline.stages
        if world % stages and not cfg.pipeline.fallback_stages.strip():
            raise ConfigError(
                f"config key pipeline.stages: {stages} does not divide the world size {world} "
                "(pipeline.fallback_stages=auto lets the run choose a layout that fits)"
            )
        self.cfg = cfg = resolve_vocab(cfg)
        # Checked before any collective; the layout (stages, data-parallel size, micro-batches)
        # is settled once the ranks can agree on it (_settle_layout).
        dsc.check_precision_supported(dsc.load_ds_config(cfg, 1), cfg.train.deepspeed_config)
        self.save_dir = Path(cfg.train.save_dir)
        self.vocab, self.data_manifest_sha256 = vocab_identity(cfg)
        RunLock.check_dir(self.save_dir)  # new, empty or its own run (formats/dirs.py)
        check_writable(self.save_dir)  # every rank, before any collective: all fail alike

        self.rank, self.world = env.init_process_group(cfg.train.collective_timeout_s)
        self.metrics = MetricsLog(self.save_dir, is_logger=self.rank == 0)
        self.lock: RunLock | None = None
        self._take_lock()
        try:
            self._build(self.cfg)
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
                stop_signals.on_stop(lock.release)  # a stop while starting ends at once
                for warning in lock.warnings:
                    print(f"warning: {warning}", flush=True)
            except (LockError, OSError) as exc:
                error = str(exc) if isinstance(exc, LockError) else describe_os_error(exc)
        agree_or_raise(self.world, error)

    def close(self) -> None:
        """Release the save_dir's lock (rank 0) and the TensorBoard writer."""
        self.metrics.close()
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def _settle_layout(self, cfg: ExperimentConfig) -> ExperimentConfig:
        """The stage count, data-parallel size and micro-batches this run trains with
        (training/layout.py): a resumed run keeps its checkpoint's micro-batches per update,
        and a world size the configured stages do not fit takes pipeline.fallback_stages.
        Every rank decides the same: the device memory is the smallest rank's."""
        saved = saved_batch(self.save_dir)  # resume() reports the checkpoint's notes
        memory = collectives.to_host(collectives.all_reduce([env.device_memory_bytes()], op="min"))[
            0
        ]
        device = Device(memory, 3 * 2**30 if torch.cuda.is_available() else 0.0)
        layout = choose_layout(cfg, self.world, device, saved)
        self.layout_note = layout.note
        cfg = layout.apply(cfg)
        self.dp = layout.data_parallel
        self.ds_config = dsc.load_ds_config(cfg, self.dp)
        self.parts = partition_plan(cfg.model, cfg.pipeline.stages, cfg.pipeline.partition)
        return cfg

    def _build(self, cfg: ExperimentConfig) -> None:
        """The stage's module, DeepSpeed's engine, the data and the parts of the loop."""
        self.cfg = cfg = self._settle_layout(cfg)
        torch.manual_seed(cfg.train.seed + self.rank)
        self.loss_fn = PipeLoss(cfg.train.label_smoothing)
        # Fixed shapes: metadata only for a bucket's first micro-batch (docs/design.md §18)
        module = build_pipeline_module(
            cfg.model, self.parts, cfg.train.seed, self.loss_fn, dynamic_shape=False
        )
        # Recompute as configured, or under "auto" where the planner says this stage would
        # not fit its device without (docs/design.md §14): it costs a forward per layer.
        self.device_memory = env.device_memory_bytes()
        self.ckpt_interval = auto_checkpoint_interval(
            cfg, self.world, module.stage_id, self.device_memory
        )
        module.set_checkpoint_interval(self.ckpt_interval)
        self.recompute_for_graphs = False  # set below where the graphs want recompute
        self.graph_ranges: list[cuda_graphs.GraphedRange] = []  # the stage's, where graphed
        self.fp32 = not (
            self.ds_config.get("fp16", {}).get("enabled")
            or self.ds_config.get("bf16", {}).get("enabled")
        )
        t = cfg.train
        optimizer = SkipNonfiniteAdamW(
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
        bf16_hooks = install_bf16_grad_accumulation(self.engine)  # one kernel each (§2.3)
        self._install_graphs(cfg, module, bf16_hooks)
        self.module, self.optimizer, self.scheduler = module, optimizer, scheduler
        self.stage_id = self.engine.stage_id
        dp_id = self.engine.grid.data_parallel_id
        if self.fp32:
            install_fp32_grad_norm(self.engine, module, optimizer, spec_names(cfg.model))
        reads_data = self.engine.is_first_stage() or self.engine.is_last_stage()
        self.stream = TrainStream(cfg, self.dp, dp_id, reads_data, self._signal_agreed)
        self.state = TrainState()
        self.checkpointer = Checkpointer(
            cfg,
            self.rank,
            self.world,
            self.state,
            engine=self.engine,
            optimizer=optimizer,
            scheduler=scheduler,
            stream=self.stream,
            parts=self.parts,
            ds_config=self.ds_config,
            vocab=self.vocab,
            data_manifest_sha256=self.data_manifest_sha256,
            log=self.metrics.log,
        )
        self.validator = Validator(
            cfg, self.engine, self.loss_fn, self.world, self.dp, dp_id, self.metrics
        )
        self.progress = Progress(
            self.metrics, t.log_interval, t.max_steps, t.max_time_minutes, gpus=self.world
        )
        self.stopper = Stopper(
            self.world, t.max_time_minutes, lambda: self.metrics.error, self.progress.elapsed
        )
        self.skips = NonfiniteSkips(
            t.max_consecutive_skips, self.fp32, self.save_dir, self.metrics, self.rank == 0
        )

    def _install_graphs(self, cfg: ExperimentConfig, module, bf16_hooks: bool) -> None:
        """The stage's layer stack as CUDA graphs per bucket shape (docs/design.md §19), where
        ``model.cuda_graphs`` and the run allow. Under activation_checkpoint_interval=auto a
        stage that fits without recompute still recomputes where that lets its graphs replay
        enough more of its micro-batches to make it faster (planner.RunPlan.graphs_pay)."""
        settings = dict(
            device=torch.device(self.engine.device),
            bucket_shapes=cfg.data.bucket_shapes,
            compiled=cfg.model.compile,
            grads_handed_over=bf16_hooks and self.engine.optimizer.immediate_grad_update,
            autocast=bool(self.ds_config.get("torch_autocast", {}).get("enabled")),
        )
        shapes = 0  # the most bucket shapes the stage's graphs take; 0: no graphs
        if cfg.model.cuda_graphs != "off" and cuda_graphs.eager_reason(**settings) is None:
            shapes = max_shapes_of(cfg.data.bucket_shapes)
            interval = auto_checkpoint_interval(
                cfg, self.world, module.stage_id, self.device_memory, shapes
            )
            self.recompute_for_graphs = interval != self.ckpt_interval
            if self.recompute_for_graphs:
                self.ckpt_interval = interval
                module.set_checkpoint_interval(interval)
        memory, link_layers = 0.0, 0
        if shapes:  # the plan's bounds: static buffers kept beside the planned run, and a
            # recomputing stage's links (planner.RunPlan.graph_allowance, link_layers)
            plan = stage_plan(cfg, self.world, self.device_memory, shapes)
            stage = plan.stage_plans[module.stage_id]
            memory, link_layers = plan.graph_allowance(stage), plan.link_layers(stage)
        self.graph_ranges = cuda_graphs.install(
            module,
            cfg.model.cuda_graphs,
            checkpoint_interval=self.ckpt_interval,
            log=self._stage_log,
            memory=memory,
            link_layers=link_layers,
            **settings,
        )

    def describe_memory(self) -> str:
        """What the planner gave this rank's stage (for the out-of-memory line): its planned
        peak against the device, whether it recomputes, and its CUDA graphs if it captured any
        (cuda_graphs.memory_note)."""
        plan = stage_plan(self.cfg, self.world, self.device_memory)
        peak = plan.stage_plans[self.stage_id].total(bool(self.ckpt_interval), plan.overhead)
        how = "recomputing every layer" if self.ckpt_interval else "without recompute"
        graphs = cuda_graphs.memory_note(self.graph_ranges)
        return (
            f"stage {self.stage_id} was planned at {peak / 2**30:.1f} GiB of "
            f"{self.device_memory / 2**30:.1f} GiB, {how}{graphs}"
        )

    def describe_recompute(self) -> str:
        """The start-up line of activation_checkpoint_interval=auto: what this stage chose."""
        what = "recomputes every layer" if self.ckpt_interval else "does not recompute"
        if self.recompute_for_graphs:
            what += " so that its CUDA graphs replay every bucket shape it can"
        return (
            f"activation checkpointing auto: stage {self.stage_id} {what} "
            f"({self.device_memory / 2**30:.1f} GiB per rank)"
        )

    def _stage_log(self, line: str) -> None:
        """A line about this stage, printed by its first data-parallel replica."""
        if self.engine.grid.data_parallel_id == 0:
            print(f"rank {self.rank} (stage {self.engine.stage_id}): {line}", flush=True)

    def train(self) -> int:
        """Run to train.max_steps (or the time budget, or a signal, or early stopping);
        returns the exit code. The save_dir's lock is released however it ends."""
        try:
            return self._train()
        finally:
            self.close()

    def _train(self) -> int:
        max_steps = self.cfg.train.max_steps
        state = self.state
        self._start()
        # From here a SIGTERM is read at the collective checks (before: it ends the rank at once)
        stop_signals.training_started()
        if self.stopper.signalled_before_start():
            self.metrics.log(
                f"signal received before the first update (step {state.step}): nothing new to "
                f"save, exiting {REQUEUE_EXIT_CODE}"
            )
            collectives.barrier()
            return REQUEUE_EXIT_CODE
        exit_code = DONE
        if state.step >= max_steps:
            self.metrics.log(
                f"nothing to train: the run is at step {state.step} and train.max_steps is "
                f"{max_steps} (raise train.max_steps to train on)"
            )
        first = state.step
        while state.step < max_steps:
            update = state.step + 1  # the update tried; state.step counts the applied ones
            result = self._update(update)
            if result is None:  # a stop signal ended the update's drawing, on every rank
                exit_code = self._stop_while_drawing(first)
                break
            if not result.applied and self.skips.stop_after_skip(
                update=update,
                applied_updates=state.step,
                where=self._nonfinite_at(),
                loss_scale=self._loss_scale(),
                ids_hash=result.ids_hash,
            ):
                exit_code = NONFINITE_EXIT_CODE
                break
            if result.applied and self.progress.due(state.step):
                self._write_progress(result)
            if result.applied and self.validator.due(state.step) and self.validator.run(state.step):
                self.checkpointer.save()
                self.validator.record_early_stop(state.step)
                break
            stop = self.stopper.check()
            if stop is not None:
                self.checkpointer.save()
                exit_code = self._log_stop(stop)
                break
            if result.applied and self.checkpointer.due(state.step):
                self.checkpointer.save()
        else:
            self.checkpointer.save_if_missing()
        self.stopper.settle()  # an error of the last update a deferred check has not read
        collectives.barrier()
        return exit_code

    def _update(self, t: int) -> UpdateResult | None:
        """Update ``t`` (applied updates + 1): its batches, alpha_t, one ``train_batch``. An
        applied update advances the state's step; a skipped one (a non-finite gradient norm)
        only its samples. None: a stop signal ended the drawing of its batches (nothing ran)."""
        alpha = set_branch_scale(self.module, self.cfg.model, t)
        update = self.stream.next_update()
        if update is None:
            return None
        self.state.samples += update.samples
        self.loss_fn.reset()
        self.loss_fn.scale = self.cfg.train.micro_batches * self.dp / max(update.target_tokens, 1)
        lr = self.optimizer.param_groups[0]["lr"]
        with fixed_shapes(self.engine, update.shapes):  # each micro-batch's bucket, or None
            self.engine.train_batch(data_iter=as_engine_items(update.mine, self.engine.device))
        loss_sums = reduce_loss_sums(self.loss_fn)  # on the device: read when logged
        applied = bool(self.engine.was_step_applied())
        if applied:
            self.state.step += 1
            src = update.all_tokens - update.target_tokens
            flops = training_flops(self.cfg.model, src, update.target_tokens, update.samples)
            self.progress.count(update.all_tokens, flops)
            self.skips.applied()
        return UpdateResult(applied, alpha, lr, loss_sums, update.ids_hash, update.all_tokens)

    def _signal_agreed(self) -> bool:
        """Whether a stop signal reached any rank (a collective: the stream asks it at the
        same draws of a long update on every rank, training/data.STOP_CHECK_DRAWS)."""
        flag = collectives.all_reduce([float(stop_signals.received() != 0)], op="max")
        return bool(collectives.to_host(flag)[0])

    def _stop_while_drawing(self, first: int) -> int:
        """A stop signal ended an update's drawing (the stream is back at its first batch):
        as the stop check after an update, save the last applied update's checkpoint (unless
        it exists, or this run applied none: nothing new to save) and exit with the requeue
        code."""
        if self.state.step == first:
            self.metrics.log(
                f"signal received before the first update (step {first}): nothing new to "
                f"save, exiting {REQUEUE_EXIT_CODE}"
            )
            return REQUEUE_EXIT_CODE
        self.checkpointer.save_if_missing()
        return self._log_stop("signal")

    def _start(self) -> None:
        """Resume (when save_dir has a checkpoint), record the run's config, say what runs."""
        cfg = self.cfg
        self.checkpointer.resume()  # sets self.state
        agree_or_raise(self.world, self.stream.update_too_large())  # the epoch's plan is built
        agree_on_shapes(self.stream, self.stage_id)  # before any fixed-shape send (§18)
        self.checkpointer.record_start()
        print(f"rank {self.rank} (stage {self.stage_id}): {self.stream.describe()}", flush=True)
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        self.metrics.log(
            f"world {self.world} = {cfg.pipeline.stages} stages x {self.dp} data-parallel; "
            f"{self.threads} threads/rank; {describe_layernorm(cfg.model.layernorm_impl, device_type)}"
        )
        if self.layout_note:
            self.metrics.log(self.layout_note)
        self.metrics.log(describe_plan(cfg.model, self.parts))
        buckets = self.stream.describe_buckets() if self.rank == 0 else None
        if buckets is not None:  # None: data.bucket_shapes=0
            self.metrics.log(buckets)
        counts = self.stream.direction_counts() if self.rank == 0 else None
        if counts is not None:  # None: synthetic data
            table = sampling_table(*counts, cfg.data.sampling_temperature)
            for line in format_sampling_table(table, cfg.data.sampling_temperature):
                self.metrics.log(line)
            write_sampling_table(self.save_dir / SAMPLING_FILE, table)
        if cfg.pipeline.activation_checkpoint_interval == "auto":
            self.metrics.log(self.describe_recompute())
        self.progress.start(self.state.step)  # the clock of elapsed_s, the ETA, the time budget
        self.validator.restore_patience(self.state.step, self.rank, self.save_dir)

    def _write_progress(self, result: UpdateResult) -> None:
        """The metrics row of the applied update ``result`` (reads its loss sums: a host sync)."""
        loss_sum, nll_sum, count = read_loss_sums(result.loss_sums)
        gn = self.engine.get_global_grad_norm()
        self.progress.write(
            UpdateFigures(
                step=self.state.step,
                loss=loss_sum / max(count, 1),
                nll_loss=nll_sum / max(count, 1),
                lr=result.lr,
                grad_norm=None if gn is None else float(gn),
                alpha=result.alpha,
                loss_scale=self._loss_scale(),
                samples=self.state.samples,
                ids_hash=result.ids_hash,
                skipped_steps=self.skips.skipped_steps,
                memory_mb=env.peak_memory_mb(),
                memory_reserved_mb=env.peak_reserved_mb(),
            )
        )

    def _log_stop(self, why: str) -> int:
        if why == "signal":
            self.metrics.log(f"signal received: checkpoint saved, exiting {REQUEUE_EXIT_CODE}")
            return REQUEUE_EXIT_CODE
        budget = self.cfg.train.max_time_minutes
        self.metrics.log(f"time budget of {budget} min reached at step {self.state.step}")
        return DONE

    def _nonfinite_at(self) -> tuple[int, str] | None:
        return getattr(self.optimizer, "nonfinite_at", None) if self.fp32 else None

    def _loss_scale(self) -> float:
        """fp16's dynamic loss scale (DeepSpeed's optimizer); 1.0 in fp32 and bf16."""
        return 1.0 if self.fp32 else float(getattr(self.engine.optimizer, "cur_scale", 1.0))


def agree_on_shapes(stream: TrainStream, stage: int) -> None:
    """Collective (one object all-gather): a :class:`TrainError` on every rank when a rank
    derived other bucket shapes, or another order of them, than rank 0
    (:func:`megatron_branchnorm.training.data.shape_disagreement`). Every rank derives them
    itself, stages that read no data too (docs/design.md §18), and the pipeline then sends
    tensors of those shapes without their sizes: NCCL would hang or read garbage."""
    problem = shape_disagreement(collectives.all_gather_object((stage, stream.shape_identity())))
    if problem is not None:
        raise TrainError(problem)


def run(cfg: ExperimentConfig) -> int:
    """Train with ``cfg``; returns the process exit code.

    The process group is destroyed when the ranks end together (done, stopped by a signal, or
    an error they agreed on): left to the interpreter's exit, gloo's worker threads are torn
    down after Python and a rank sometimes aborts with "terminate called without an active
    exception" (SIGABRT: exit 0 or 75 became -6; seen in the demo test, pytorch#190489).
    After an error of one rank alone the others may still be in a collective, so it is left.
    """
    trainer = None
    try:
        trainer = Trainer(cfg)
        code = trainer.train()
    except torch.OutOfMemoryError as exc:  # before RuntimeError, of which it is one
        rank = os.environ.get("RANK", "0")
        plan = trainer.describe_memory() if trainer is not None else "while building the stage"
        print(
            f"error: rank {rank}: the device ran out of memory ({one_line(str(exc))[:160]}); "
            f"{plan}; nothing was saved since the last checkpoint. Lower the memory: "
            "pipeline.activation_checkpoint_interval=1 (recompute every layer), a smaller "
            "data.max_tokens or more pipeline stages (python tools/plan_memory.py shows the plan)",
            file=sys.stderr,
            flush=True,
        )
        return OUT_OF_MEMORY_EXIT_CODE
    except TrainError:
        env.destroy_process_group()
        raise
    except RuntimeError as exc:
        if not env.peer_lost(exc):
            raise
        # The others are failing alike or already gone: no collective, no save, no teardown.
        try:
            latest = ckpt.read_latest(Path(cfg.train.save_dir))
        except (OSError, ckpt.CheckpointError):
            latest = None
        rank = os.environ.get("RANK", "0")
        what = (
            str(exc)
            if isinstance(exc, env.PeerLostError)
            else "a collective failed because another rank, or its node, is gone or stopped "
            f"answering ({one_line(str(exc))[:200]})"
        )
        print(
            f"error: rank {rank}: {what}; nothing was saved: resubmit the job to resume from "
            + (f"{cfg.train.save_dir}/{latest}" if latest else "the start (no checkpoint yet)"),
            file=sys.stderr,
            flush=True,
        )
        return PEER_LOST_EXIT_CODE
    env.destroy_process_group()
    sys.stdout.flush()
    return code
