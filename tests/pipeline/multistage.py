"""The runs of the 3- and 4-stage checks (tests/pipeline/multistage_harness.py runs them on
gloo ranks, test_multistage.py compares them with one process).

tiny_cpu is 6L-6L: layer list ``E e*6 d*6 L``. The layouts put stage boundaries inside the
encoder, exactly at the encoder/decoder switch and inside the decoder, and give a middle
stage that holds only decoder layers (and one that holds only encoder layers).
"""

from __future__ import annotations

from pathlib import Path

STEPS = 10
BASE = [
    "model.dropout=0.0",
    "train.micro_batches=4",
    f"train.max_steps={STEPS}",
    "train.log_interval=1",
    "train.eval_interval=0",
    "train.save_interval=0",
    "pipeline.activation_checkpoint_interval=1",
]
"""Shared by every run and by the one-process reference (which has no checkpointing to do:
one stage, activation checkpointing changes no number)."""

RUNS: dict[str, dict] = {
    # boundary inside the encoder and inside the decoder; the middle stage holds the switch
    "s3_mixed": {"world": 3, "layout": "E e*3 | e*3 d*3 | d*3 L"},
    # boundary exactly at the switch; the middle stage holds only decoder layers
    "s3_switch": {"world": 3, "layout": "E e*6 | d*3 | d*3 L"},
    # inside the encoder, at the switch, inside the decoder; middle stages enc-only, dec-only
    "s4_layout": {"world": 4, "layout": "E e*3 | e*3 | d*3 | d*3 L"},
    # our balanced plan, with dropout, saves every 4 and validation (eval_batch through
    # 4 stages) every 5: the uninterrupted reference of the SIGUSR1 + resume test
    "s4_resume_ref": {
        "world": 4,
        "layout": "balanced",
        "extra": ["model.dropout=0.1", "train.save_interval=4", "train.eval_interval=5"],
    },
}
PARITY_LAYOUTS = {
    # parity() uses a 3L-3L model: E e*3 d*3 L
    3: ["E e*2 | e d | d*2 L", "E e*3 | d | d*2 L"],
    4: ["E e | e*2 | d*2 | d L", "balanced"],
}


def run_overrides(name: str, out_dir: Path) -> list[str]:
    """tiny_cpu overrides of run ``name`` saving under ``out_dir / name``."""
    spec = RUNS[name]
    return [
        *BASE,
        f"pipeline.stages={spec['world']}",
        f"pipeline.partition={spec['layout']}",
        f"train.save_dir={out_dir / name}",
        *spec.get("extra", []),
    ]
