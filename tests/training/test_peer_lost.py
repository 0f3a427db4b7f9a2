"""A rank whose peer is gone says so in one line and exits 4 (training/environment.peer_lost,
training/trainer.run; the processes are in tests/faults/test_kills.py and
tests/slurm/test_node_loss.py): which backend errors count as a lost peer, and which do not."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch.distributed as dist

from megatron_branchnorm.formats.checkpoint import CheckpointError
from megatron_branchnorm.training.environment import peer_lost

GLOO = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:{}] {}"


@pytest.mark.parametrize(
    "exc",
    [  # as gloo and NCCL raise them (messages seen in the node-loss rehearsal, torch 2.13)
        RuntimeError(GLOO.format(537, "Read error [127.0.0.1]:9621: Connection reset by peer.")),
        RuntimeError(GLOO.format(553, "Connection closed by peer [127.0.0.1]:5010.")),
        RuntimeError(
            "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out "
            "waiting 30000ms for recv operation to complete"
        ),
        dist.DistBackendError(
            "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was a "
            "network error, NCCL version 2.21.5 ncclRemoteError"
        ),
    ],
)
def test_a_peer_gone_is_recognised(exc):
    assert peer_lost(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
        RuntimeError("Connection reset by peer"),  # not from a collective backend
        CheckpointError("global_step4/layer_03-model_states.pt: checksum mismatch"),
        ValueError("gloo: Connection reset by peer"),  # not a RuntimeError
        dist.DistBackendError("NCCL error: unhandled cuda error, NCCL version 2.21.5"),
    ],
)
def test_other_errors_are_not_taken_for_a_lost_peer(exc):
    assert not peer_lost(exc)


def test_out_of_memory_is_one_line_with_the_stage_plan_and_exit_5(tmp_path, monkeypatch, capsys):
    """The device running out of memory in an update (as torch raises it on CUDA, here raised
    in the second update of a real trainer): one line naming the rank, what the planner gave
    the stage, and the levers; exit 5, not requeued; the save_dir's lock released."""
    import torch

    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.training import trainer
    from megatron_branchnorm.training.exit_codes import OUT_OF_MEMORY_EXIT_CODE
    from megatron_branchnorm.training.run_lock import LOCK_NAME
    from tests.core.helpers import one_rank_process_group

    cfg = load_config("tiny_cpu", [f"train.save_dir={tmp_path}", "train.max_steps=4",
                                   "train.eval_interval=0", "train.save_interval=0"])  # fmt: skip
    update = trainer.Trainer._update

    def update_then_oom(self, t: int):
        if t == 2:
            # as a stage whose graphs a GPU captured (tests/training/test_cuda_graphs.py has
            # the note on real captures): the line says so and how to free their memory
            self.graph_ranges = [SimpleNamespace(captures=3, links=[[]], recompute=None)]
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                "79.19 GiB of which 1.05 GiB is free.\nOf the allocated memory 75.1 GiB is "
                "allocated by PyTorch"
            )
        return update(self, t)

    monkeypatch.setattr(trainer.Trainer, "_update", update_then_oom)
    with one_rank_process_group():
        code = trainer.run(cfg)
    assert code == OUT_OF_MEMORY_EXIT_CODE == 5
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(err) == 1
    line = err[0]
    assert line.startswith("error: rank 0: the device ran out of memory (CUDA out of memory.")
    assert "stage 0 was planned at " in line and "without recompute" in line
    assert "pipeline.activation_checkpoint_interval=1" in line and "tools/plan_memory.py" in line
    assert "with 3 CUDA graph(s) captured" in line and "resume with model.cuda_graphs=off" in line
    assert not (tmp_path / LOCK_NAME).exists() and not (tmp_path / "latest").exists()
