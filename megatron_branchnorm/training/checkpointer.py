"""Checkpoints of a run: save (``latest`` moves only once a checkpoint is complete), retention,
and resume: the same layout exactly, or another stage layout layer by layer
(docs/design.md §6; the on-disk format: megatron_branchnorm/formats/checkpoint.py)."""

from __future__ import annotations

import bisect
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from megatron_branchnorm.config import ConfigError, ExperimentConfig
from megatron_branchnorm.formats import checkpoint as ckpt
from megatron_branchnorm.formats import checkpoint_state, train_config
from megatron_branchnorm.formats.files import one_line
from megatron_branchnorm.formats.outputs import describe_os_error
from megatron_branchnorm.parallel.partition import (
    engine_param_to_flat_key,
    pipe_to_flat_key,
    spec_names,
)
from megatron_branchnorm.training import collectives, resume_policy, retention
from megatron_branchnorm.training.checkpoint_engine import install_checkpoint_engine
from megatron_branchnorm.training.data import TrainStream
from megatron_branchnorm.training.ds_config import precision_of
from megatron_branchnorm.training.lr_schedule import inverse_sqrt_factor
from megatron_branchnorm.training.state import TrainState
from megatron_branchnorm.training.stopping import agree_or_raise


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


class Checkpointer:
    """Saves and resumes this rank's part of the run: its DeepSpeed engine's files, its RNG
    state, and (rank 0) the run's manifest, config and ``latest``. The training position is
    the Trainer's ``state``: a save records it, a resume sets it."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        rank: int,
        world: int,
        state: TrainState,
        *,
        engine,
        optimizer: torch.optim.Optimizer,
        scheduler,
        stream: TrainStream,
        parts: list[int],
        ds_config: dict,
        vocab: dict | None,
        data_manifest_sha256: str | None,
        log: Callable[[str], None],
    ) -> None:
        self.cfg = cfg
        self.save_dir = Path(cfg.train.save_dir)
        self.rank, self.world = rank, world
        self.dp = world // cfg.pipeline.stages
        self.engine, self.module = engine, engine.module
        install_checkpoint_engine(engine, cfg.train.deepspeed_config)  # loads weights only
        self.optimizer, self.scheduler = optimizer, scheduler
        self.stream = stream
        self.parts = parts
        self.ds_config = ds_config
        self.vocab = vocab
        self.data_manifest_sha256 = data_manifest_sha256
        self.state = state
        self.log = log
        self.save_error: str | None = None  # this rank's part of the save in progress failed
        self.resumed_from: str | None = None
        self.config_changes: dict[str, list] = {}

    # ---- when -------------------------------------------------------------------------------

    def due(self, step: int) -> bool:
        """A periodic save after update ``step`` (train.save_interval)."""
        interval = self.cfg.train.save_interval
        return bool(interval) and step % interval == 0

    def save_if_missing(self) -> None:
        """The end of training: save unless the last update's checkpoint exists."""
        if not (self.save_dir / ckpt.tag_for(self.state.step) / ckpt.MANIFEST).is_file():
            self.save()

    # ---- save -------------------------------------------------------------------------------

    def save(self) -> None:
        """Checkpoint at the state's step; ``latest`` moves only once it is complete.

        A rank whose part of the save fails (a full disk, a quota) does not leave the others
        waiting in a barrier: the failure is agreed on (:func:`agree_or_raise`) and every rank
        raises the same one-line TrainError. The tag then has no manifest, so it is never
        loaded, and ``latest`` still names the last complete checkpoint. Ctrl-C during the save
        removes the unfinished tag (rank 0) before it ends the run, so "nothing half-written
        was kept" (cli.run_main) is true.
        """
        # Rank 0 reads data (first stage): its stream position and sample count are the run's;
        # a middle stage builds no batches, and every stage's file must hold the same state.
        step = self.state.step
        sampler, samples = collectives.broadcast_object(
            (self.stream.state_dict(), self.state.samples) if self.rank == 0 else None
        )
        tag = ckpt.tag_for(step)
        tag_dir = self.save_dir / tag
        record = train_config.TrainConfigRecord(
            step=step,
            samples=samples,
            sampler=sampler,
            spec_names=spec_names(self.cfg.model),
            parts=tuple(self.parts),
            config=self.cfg.to_dict(),
            vocab=None
            if self.vocab is None
            else train_config.VocabRecord(self.vocab["spm_sha256"], self.vocab["vocab_size"]),
            data_manifest_sha256=self.data_manifest_sha256,
            precision=precision_of(self.ds_config),
            data_parallel=self.dp,
            where=tag_dir / ckpt.TRAIN_CONFIG,
        )
        t0 = time.time()
        if self.rank == 0 and tag_dir.is_dir() and not (tag_dir / ckpt.MANIFEST).is_file():
            shutil.rmtree(tag_dir)  # leftovers of a save that was killed: start clean
        collectives.barrier()
        try:
            self._save(tag_dir, record)
        except KeyboardInterrupt:
            if self.rank == 0 and not (tag_dir / ckpt.MANIFEST).is_file():
                shutil.rmtree(tag_dir, ignore_errors=True)
            raise
        self.log(f"saved checkpoint {tag_dir} in {time.time() - t0:.1f}s")
        self._retain()

    def _save(self, tag_dir: Path, record: train_config.TrainConfigRecord) -> None:
        """The files of one save, then (rank 0) its manifest and ``latest``. DeepSpeed keeps
        the record's JSON object as each engine file's client state too."""
        step, tag = record.need("step"), tag_dir.name
        client = record.to_json()
        self._guard_checkpoint_engine()
        self.save_error = None
        # Each stage's engine file also names its fp32 optimizer's parameters in order (torch
        # keys the state by position), so a resume in another layout can place them.
        names = self._optimizer_param_names()
        self.engine.save_checkpoint(
            str(self.save_dir),
            tag=tag,
            client_state={**client, checkpoint_state.OPTIMIZER_PARAM_NAMES: names}
            if names
            else client,
            save_latest=False,
        )
        if self.save_error is None:
            rng_path = ckpt.rng_file(tag_dir, self.rank)
            try:
                torch.save(ckpt.rng_state(), rng_path)
            except (OSError, RuntimeError) as exc:
                self.save_error = self._describe_save_failure(exc, rng_path)
        agree_or_raise(self.world, self.save_error)
        error = None
        if self.rank == 0:
            try:
                if self.vocab is not None:
                    shutil.copyfile(self.vocab["path"], tag_dir / ckpt.SPM_IN_CHECKPOINT)
                train_config.write_train_config(tag_dir, record)
                ckpt.write_manifest(tag_dir, step)
                ckpt.write_latest(self.save_dir, tag)
            except OSError as exc:
                error = f"checkpoint {tag_dir} not saved: {describe_os_error(exc)}"
            except ckpt.CheckpointError as exc:  # an entry no save writes: the tag stays incomplete
                error = f"checkpoint {tag_dir} not saved: {exc}"
        agree_or_raise(self.world, error)

    def _optimizer_param_names(self) -> list[list[str]] | None:
        """The engine's parameter names of each param group of the fp32 optimizer, in its
        order; None when the engine's optimizer is DeepSpeed's (bf16, fp16: its files name
        their parameters)."""
        if self.engine.optimizer is not self.optimizer:
            return None
        names = {id(p): n for n, p in self.module.named_parameters()}
        return [[names[id(p)] for p in g["params"]] for g in self.optimizer.param_groups]

    def _retain(self) -> None:
        """Checkpoint retention after a complete save (rank 0; every rank has finished
        writing: the save ends in a collective). A failure to delete is a warning: the run
        goes on, the next save tries again."""
        t = self.cfg.train
        if self.rank != 0 or not (t.keep_last or t.keep_best):
            return
        try:
            _, line = retention.apply_retention(
                self.save_dir, t.keep_last, t.keep_best, t.best_metric
            )
        except OSError as exc:
            line = f"warning: checkpoint retention failed: {describe_os_error(exc)}"
        self.log(line)

    def _describe_save_failure(self, exc: BaseException, path) -> str:
        """One line for a failed checkpoint file: torch.save reports a full disk as a
        RuntimeError from its zip writer ("unexpected pos ..."), so the free space is said."""
        tag_dir = self.save_dir / ckpt.tag_for(self.state.step)
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

    def _guard_checkpoint_engine(self) -> None:
        """Wrap DeepSpeed's checkpoint engine's ``save`` (every file DeepSpeed writes): an
        OSError (a full disk) is recorded in :attr:`save_error` instead of raised, and the
        rank's remaining files are skipped, so DeepSpeed's own collectives in
        ``save_checkpoint`` (tag validation, its final barrier) still match across ranks and
        the failure is agreed on afterwards."""
        engine = self.engine.checkpoint_engine
        if getattr(engine, "_mbn_guarded", False):
            return
        save = engine.save

        def guarded_save(*args, **kwargs):
            if self.save_error is not None:
                return None
            try:
                out = save(*args, **kwargs)
            except (OSError, RuntimeError) as exc:  # torch.save: RuntimeError on a full disk
                path = kwargs.get("path", args[1] if len(args) > 1 else None)
                self.save_error = self._describe_save_failure(exc, path)
                return None
            return out

        engine.save, engine._mbn_guarded = guarded_save, True

    # ---- resume -----------------------------------------------------------------------------

    def resume(self) -> None:
        """Resume from the newest complete checkpoint (``latest``, or a complete one newer than
        it), verified against its checksums; an unreadable ``latest`` is an error. Every file
        is read with ``weights_only=True`` (DeepSpeed's through the engine's checkpoint engine,
        training/checkpoint_engine.py). Sets the state's step and samples; nothing changes
        when there is no checkpoint."""
        tag, notes = ckpt.resume_tag(self.save_dir)
        for note in notes:
            self.log(f"warning: {note}")
        if tag is None:
            return
        tag_dir = self.save_dir / tag
        ckpt.verify_checkpoint(tag_dir)  # exactly the files it lists: DeepSpeed's load globs
        saved = train_config.read_train_record(tag_dir)
        self.resumed_from = tag
        self.config_changes = self._check_resume_config(tag_dir, saved)
        self._check_precision(tag_dir, saved.precision)
        partitions = {len(by_dp) for by_dp in checkpoint_state.optim_files(tag_dir).values()}
        if (
            list(saved.need("parts")) != list(self.parts)
            or saved.repartitioned
            or (partitions and partitions != {self.dp})
        ):
            self._resume_other_layout(tag_dir, saved)
            return
        load_path, client = self.engine.load_checkpoint(str(self.save_dir), tag=tag)
        if load_path is None:
            raise ckpt.CheckpointError(f"{tag_dir}: DeepSpeed could not load the checkpoint")
        # DeepSpeed's copy of the record (the client state of this stage's engine file)
        loaded = train_config.TrainConfigRecord.from_json(
            client, tag_dir / ckpt.engine_file(self.engine.stage_id)
        )
        self.state.step = loaded.need("step")
        self.state.samples = loaded.need("samples")
        self.stream.load_state_dict(loaded.need("sampler"))
        rng_path = ckpt.rng_file(tag_dir, self.rank)
        if rng_path.is_file():
            ckpt.restore_rng_state(rng_path)
        else:
            self.log(f"warning: {rng_path} missing (different world size): RNG not restored")
        if self.scheduler.last_epoch != self.state.step:
            raise ckpt.CheckpointError(
                f"{tag_dir}: LR scheduler at {self.scheduler.last_epoch}, step {self.state.step}"
            )
        self._apply_optimizer_config()
        self.log(f"resumed from {tag_dir} at step {self.state.step}")

    def _check_precision(self, tag_dir: Path, old_precision: str | None) -> None:
        """The checkpoint's precision and ZeRO stage must be this run's: DeepSpeed's optimizer
        state differs between them."""
        if old_precision is not None and old_precision != precision_of(self.ds_config):
            raise ConfigError(
                f"config key train.deepspeed_config: {self.cfg.train.deepspeed_config} trains in "
                f"{precision_of(self.ds_config)}, the checkpoint {tag_dir} in {old_precision}: "
                "DeepSpeed's optimizer state differs between them; use a DeepSpeed JSON with the "
                "checkpoint's precision and ZeRO stage"
            )

    def _check_resume_config(self, tag_dir: Path, saved: train_config.TrainConfigRecord) -> dict:
        """The checks a resume makes against the checkpoint: first the vocabulary (the data's
        SentencePiece model must be the one the checkpoint was trained with: its sha256 in
        ``train_config.json``), then the config, key by key (module resume_policy: a fixed
        key that differs is an error). Returns the allowed changes."""
        if not saved.vocab_recorded:
            self.log(
                f"warning: {tag_dir} predates vocabulary checks: the SentencePiece model of "
                f"{self.cfg.data.dataset} cannot be checked against it"
            )
        else:
            old = saved.vocab.spm_sha256 if saved.vocab is not None else None
            new = (self.vocab or {}).get("spm_sha256")
            if old != new:
                mine = self.vocab["path"] if self.vocab else "synthetic data (no vocabulary)"
                theirs = f"{tag_dir / ckpt.SPM_IN_CHECKPOINT}" if old else "synthetic data"
                raise ConfigError(
                    f"config key data.dataset: {mine} is not the vocabulary the checkpoint was "
                    f"trained with ({theirs}; sha256 {str(old)[:12]} vs {str(new)[:12]}); "
                    "resume with the checkpoint's data or use a new train.save_dir"
                )
        same_data = (
            self.data_manifest_sha256 is not None
            and saved.data_manifest_sha256 == self.data_manifest_sha256
        )
        return resume_policy.check_resume(
            saved.need("config"), self.cfg.to_dict(), str(tag_dir), same_data
        )

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
            group["lr"] = t.lr * factor(self.state.step)
            group["betas"] = (t.adam_beta1, t.adam_beta2)
            group["eps"] = t.adam_eps
            group["weight_decay"] = t.weight_decay
        self.scheduler._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def _resume_other_layout(self, tag_dir: Path, saved: train_config.TrainConfigRecord) -> None:
        """Resume a checkpoint written in another layout (stage count, split or data-parallel
        size) with the whole training state (docs/design.md §17): weights layer by layer
        (layer files are named by their index in the layer list, not by stage); fp32 master
        weights, Adam's moments and step per parameter from the optimizer files of the saved
        stages that held this stage's layers; step, data position and the LR schedule.
        Each rank reads only those stages' files: a rank of a 1000-layer model never loads
        the whole model. The RNG streams are per rank, so a new layout seeds them afresh
        from (seed, step, rank)."""
        stage = self.engine.stage_id
        names = spec_names(self.cfg.model)
        # DeepSpeed names a parameter by its entry's index, or tied_modules.* (the embedding,
        # saved in entry 0's file and held by the stages that use it).
        params = dict(self.module.named_parameters())
        mine = {int(k.split(".", 1)[0]) for k in params if k[0].isdigit()}
        tied = len(self.module.tied_modules) > 0
        entries = set(range(self.parts[stage], self.parts[stage + 1])) | ({0} if tied else set())
        _, flat = checkpoint_state.read_checkpoint(  # resume verified it
            tag_dir, pipe_to_flat_key, verify=False, indices=entries, info=saved
        )
        state = {}
        for key in self.module.state_dict():
            flat_key = engine_param_to_flat_key(key, names)
            if flat_key not in flat:
                raise ckpt.CheckpointError(f"{tag_dir}: no weights for {flat_key}")
            state[key] = flat[flat_key]
        self.module.load_state_dict(state, strict=True)
        old_parts = list(saved.need("parts"))
        old_stages = {_stage_of(old_parts, idx) for idx in mine} | ({0} if tied else set())
        optim = checkpoint_state.read_optimizer_state(
            tag_dir,
            lambda name: engine_param_to_flat_key(name, names),
            old_stages,
            keys={engine_param_to_flat_key(k, names) for k in params},
        )
        if optim is not None:
            self._place_optimizer_state(tag_dir, optim, names)
        self.state.step = saved.need("step")
        self.state.samples = saved.need("samples")
        self.stream.load_state_dict(saved.need("sampler"))
        self.scheduler.last_epoch = self.state.step
        self.engine.global_steps = self.state.step
        self.engine.global_samples = self.state.samples
        self._apply_optimizer_config()
        ckpt.seed_rng(self.cfg.train.seed, self.state.step, self.rank)
        old_dp = train_config.saved_data_parallel(tag_dir, saved)
        old = f"{len(old_parts) - 1} stages {old_parts} x {old_dp}"
        new = f"{len(self.parts) - 1} stages {self.parts} x {self.dp}"
        if optim is None:
            self.log(
                f"warning: {tag_dir} was written with stage layout {old}, this run uses {new}: "
                f"weights loaded layer by layer at step {self.state.step}; the checkpoint holds "
                "no per-parameter optimizer state (saved before it was recorded, or re-laid by "
                "convert_checkpoint.py --repartition), so Adam's moments start fresh"
            )
            return
        self.log(
            f"resumed from {tag_dir} at step {self.state.step} in another layout ({old} -> "
            f"{new} data-parallel): weights, fp32 master weights, Adam's moments and step re-laid "
            "per parameter; RNG streams seeded from (seed, step, rank)"
        )

    def _place_optimizer_state(
        self, tag_dir: Path, full: dict[str, dict[str, torch.Tensor]], names: dict[int, str]
    ) -> None:
        """Put the per-parameter state ``full`` (formats.checkpoint_state.read_optimizer_state)
        into this rank's optimizer: torch's AdamW in fp32 (its state by position), or DeepSpeed's
        BF16 optimizer, whose flat fp32 partition on this data-parallel rank holds a fragment of
        each parameter (the fragment addresses DeepSpeed links to each parameter,
        ``_hp_mapping``); its bf16 weights are then refreshed from the masters."""

        def entry(name: str) -> dict[str, torch.Tensor]:
            key = engine_param_to_flat_key(name, names)
            if key not in full:
                raise ckpt.CheckpointError(f"{tag_dir}: no optimizer state for {key}")
            return full[key]

        if self.engine.optimizer is self.optimizer:  # fp32: torch's optimizer over the module
            by_id = {id(p): n for n, p in self.module.named_parameters()}
            sd = self.optimizer.state_dict()
            sd["state"] = {}
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
            for i, p in enumerate(params):  # torch keys the state by this position
                src = entry(by_id[id(p)])
                sd["state"][i] = {
                    "step": src["step"].clone(),
                    **{k: src[k].view_as(p) for k in checkpoint_state.ADAM_STATE},
                }
            self.optimizer.load_state_dict(sd)
            return
        bf16 = self.engine.optimizer
        if not hasattr(bf16, "fp32_groups_flat_partition"):
            raise checkpoint_state.LayoutError(
                f"{tag_dir}: this run's optimizer ({type(bf16).__name__}) is not re-laid out; "
                "resume at the checkpoint's layout"
            )
        base = bf16.optimizer
        sd = base.state_dict()
        for i, hp in enumerate(bf16.fp32_groups_flat_partition):
            moments = {k: torch.zeros_like(hp) for k in checkpoint_state.ADAM_STATE}
            step = None
            for lp in bf16.bf16_groups[i]:
                mapping = lp._hp_mapping
                if mapping is None:  # no piece of it on this data-parallel rank
                    continue
                src = entry(bf16.param_names[lp])
                lp_at, hp_at = mapping.lp_fragment_address, mapping.hp_fragment_address
                for dst, key in (
                    (hp.data, "master"),
                    *((moments[k], k) for k in checkpoint_state.ADAM_STATE),
                ):
                    piece = src[key].narrow(0, lp_at.start, lp_at.numel)
                    dst.narrow(0, hp_at.start, hp_at.numel).copy_(piece)
                step = src["step"]
            if step is None:  # a partition of padding only: the step of any parameter
                step = next(iter(full.values()))["step"]
            sd["state"][sd["param_groups"][i]["params"][0]] = {"step": step.clone(), **moments}
        base.load_state_dict(sd)
        bf16.update_lp_params()  # bf16 weights = the masters (an all-gather over data-parallel)
        # Link each parameter to its moments' fragments now, as DeepSpeed does after its first
        # step, so its fragment API (safe_get_full_optimizer_state) reads the loaded state.
        bf16._hp_optimizer_states_linked = False
        bf16._lazy_init_hp_params_optimizer_state()

    def record_start(self) -> None:
        """Rank 0 writes the run's config.yaml and appends to its resume history; the
        config changes a resume allowed are logged. Collective: a failure is every rank's."""
        error = None
        if self.rank == 0:
            from megatron_branchnorm.config import dump_config

            for key, (old, new) in self.config_changes.items():
                self.log(f"config key {key} changed on resume: {old!r} -> {new!r}")
            try:
                dump_config(self.cfg, self.save_dir / "config.yaml")
                resume_policy.append_history(
                    self.save_dir, self.state.step, self.resumed_from, self.config_changes
                )
            except OSError as exc:
                error = f"cannot write the run's config: {describe_os_error(exc)}"
        agree_or_raise(self.world, error)


def _stage_of(parts: list[int], index: int) -> int:
    """The stage of plan ``parts`` (ascending boundaries) that holds layer-list entry ``index``."""
    if not parts[0] <= index < parts[-1]:
        raise ckpt.CheckpointError(f"layer-list entry {index} is outside the saved plan {parts}")
    return bisect.bisect_right(parts, index) - 1
