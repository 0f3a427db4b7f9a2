"""The user commands: each module's ``main(argv=None) -> int`` is one command line.

Each runs as ``python -m megatron_branchnorm.commands.<module>``, through its front door
``tools/<script>.py`` in a checkout, or as a console script of an installed copy (setup.py):

| module | front door | console script |
| --- | --- | --- |
| ``train`` | ``megatron_branchnorm/train.py`` | ``mbn-train`` |
| ``preprocess`` | ``tools/preprocess_data.py`` | ``mbn-preprocess`` |
| ``convert`` | ``tools/convert_checkpoint.py`` | ``mbn-convert`` |
| ``translate`` | ``tools/translate.py`` | ``mbn-translate`` |
| ``evaluate`` | ``tools/evaluate.py`` | ``mbn-evaluate`` |
| ``plan`` | ``tools/plan_memory.py`` | ``mbn-plan`` |
| ``rehearse`` | ``tools/rehearse.py`` | ``mbn-rehearse`` |
| ``demo`` | ``tools/run_demo.py`` | ``mbn-demo`` |
| ``plot`` | ``tools/plot_training.py`` | ``mbn-plot`` |
| ``corpus`` | ``tools/build_locale_corpus.py`` | ``mbn-corpus`` |
| ``local_slurm`` | ``tools/local_slurm.py`` | |
| ``rehearse_slurm`` | ``tools/rehearse_slurm.py`` | |
| ``gpu_check`` | ``tools/gpu_check.py`` | ``mbn-gpu-check`` |
| ``watch_bleu`` | ``tools/watch_bleu.py`` | ``mbn-watch-bleu`` |

``local_slurm`` and ``rehearse_slurm`` use the checkout's ``slurm/`` launchers, so they have no
console script.
"""

COMMANDS = (
    "train",
    "preprocess",
    "convert",
    "translate",
    "evaluate",
    "plan",
    "rehearse",
    "demo",
    "plot",
    "corpus",
    "local_slurm",
    "rehearse_slurm",
    "gpu_check",
    "watch_bleu",
)
"""Module names under megatron_branchnorm.commands."""
