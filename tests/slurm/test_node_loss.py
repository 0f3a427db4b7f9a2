"""A node lost mid-run (docs/reliability.md): the shipped opus100_1000L launcher,
unchanged, on a real 2-node SLURM at 8 stages x 1 (2 nodes x 4 CPU ranks, 4L-4L); SIGKILL to
every rank on the second node once a checkpoint is complete and update 3 is logged; the
surviving ranks exit 4 with one line each; the node drained;
the same command resubmitted on one node. 8 stages do not divide 4 ranks: the config's
pipeline.fallback_stages=auto takes 1 stage x 4 data-parallel (stage count and data-parallel
size change at once), resumes from global_step2 with the whole state re-laid, and finishes.
The same at the launcher's full topology (4 x 8 -> 3 x 8) is tools/rehearse_node_loss.py."""

from __future__ import annotations

import pytest

from megatron_branchnorm.workflows.rehearse_node_loss import (
    format_node_loss,
    node_loss_spec,
    rehearse_node_loss,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SPEC = node_loss_spec(
    "slurm/opus100_1000L.sh",
    nodes=2,
    ranks_per_node=4,
    stages=8,
    steps=30,  # updates take 0.2-0.3 s: room for the kill to land mid-run under load
    save_interval=2,
    kill_after=3,
    micro_batches=4,
    overrides=["model.encoder_layers=4", "model.decoder_layers=4", "pipeline.stages=8"],
)
SPEC.time_limit = "30"  # above the launcher's USR1@600 lead


def test_a_node_lost_resumes_on_fewer_nodes_in_another_layout(slurm_cluster, tmp_path):
    result = rehearse_node_loss(
        slurm_cluster, SPEC, tmp_path / "job", timeout=900, stuck=120, poll=0.2
    )
    report = format_node_loss(result)
    print(report)  # the figures, shown with pytest -s
    logs = "\n".join(p.read_text()[-3000:] for p in result.logs if p.is_file())
    assert not result.failures(), f"{report}\n{logs}\n{slurm_cluster.logs()}"
    assert result.layout == (
        "8 stages x 1 -> 1 stages x 4 data-parallel, 1 micro-batches per replica"
    )
    slurm_cluster.wait_idle(timeout=30)  # the drained node is back for the other tests
