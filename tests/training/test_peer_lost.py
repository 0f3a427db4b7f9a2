"""A rank whose peer is gone says so in one line and exits 4 (training/environment.peer_lost,
training/trainer.run; the processes are in tests/faults/test_kills.py and
tests/slurm/test_node_loss.py): which backend errors count as a lost peer, and which do not."""

from __future__ import annotations

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
