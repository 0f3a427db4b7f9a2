"""A shipped GPU launcher, unchanged, on a real 2-node SLURM (2 x 4 CPU ranks = 4 pipeline stages
x 2 data-parallel): SIGUSR1 mid-run makes every rank checkpoint and exit 75, the job requeues
itself, resumes and finishes with a continuous metrics log (docs/slurm.md).
The same check at the launcher's full topology is tools/rehearse_slurm.py."""

from __future__ import annotations

import pytest

from megatron_branchnorm.workflows.rehearse_slurm import (
    NARROW,
    RehearsalSpec,
    format_result,
    rehearse,
)

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

STEPS = 8
# opus100_1000L shrunk in depth and width for the test budget; stages and data parallelism
# come from the 2 x 4 allocation as they would on a GPU cluster
SPEC = RehearsalSpec(
    "slurm/opus100_1000L.sh",
    nodes=2,
    ranks_per_node=4,
    stages=4,
    steps=STEPS,
    signal_after=2,
    overrides=[
        "model.encoder_layers=4",
        "model.decoder_layers=4",
        *NARROW,
        "pipeline.stages=4",
        "train.micro_batches=4",
    ],
    time_limit="30",  # above the launcher's USR1@600 lead
)


def test_opus100_1000L_launcher_on_2_nodes_signal_requeue_resume(slurm_cluster, tmp_path):
    result = rehearse(slurm_cluster, SPEC, tmp_path / "job", timeout=600)
    report = format_result(result)
    print(report)  # the figures, shown with pytest -s
    text = result.log.read_text() if result.log.is_file() else "(no job log)"
    assert not result.failures(), f"{report}\n{text[-4000:]}\n{slurm_cluster.logs()}"
    assert "on mbn[1-2]: 2 node(s) x 4 rank(s); master mbn1:" in text
    assert result.steps == list(range(1, STEPS + 1))
