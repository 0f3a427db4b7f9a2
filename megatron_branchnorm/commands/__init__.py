"""The user commands: each command's ``main(argv=None) -> int`` is one command line, run
through ``cli.run_main`` once.

Each runs as ``python -m <module>``, through its front door ``tools/<script>.py`` in a checkout,
or as a console script of an installed copy (setup.py). Most live here; the trainer's entry is
``megatron_branchnorm/train.py`` (the launchers run it by path and as a module), and the
workflows' commands live in their workflow's module (``megatron_branchnorm.workflows``):

| command | module | front door | console script |
| --- | --- | --- | --- |
| ``train`` | ``megatron_branchnorm.train`` | ``megatron_branchnorm/train.py`` | ``mbn-train`` |
| ``preprocess`` | ``commands.preprocess`` | ``tools/preprocess_data.py`` | ``mbn-preprocess`` |
| ``convert`` | ``commands.convert`` | ``tools/convert_checkpoint.py`` | ``mbn-convert`` |
| ``translate`` | ``commands.translate`` | ``tools/translate.py`` | ``mbn-translate`` |
| ``evaluate`` | ``commands.evaluate`` | ``tools/evaluate.py`` | ``mbn-evaluate`` |
| ``plan`` | ``commands.plan`` | ``tools/plan_memory.py`` | ``mbn-plan`` |
| ``rehearse`` | ``workflows.rehearse`` | ``tools/rehearse.py`` | ``mbn-rehearse`` |
| ``demo`` | ``workflows.demo`` | ``tools/run_demo.py`` | ``mbn-demo`` |
| ``plot`` | ``commands.plot`` | ``tools/plot_training.py`` | ``mbn-plot`` |
| ``corpus`` | ``commands.corpus`` | ``tools/build_locale_corpus.py`` | ``mbn-corpus`` |
| ``opus_like`` | ``commands.opus_like`` | ``tools/make_opus_like_corpus.py`` | |
| ``local_slurm`` | ``workflows.local_slurm`` | ``tools/local_slurm.py`` | |
| ``rehearse_slurm`` | ``workflows.rehearse_slurm`` | ``tools/rehearse_slurm.py`` | |
| ``gpu_check`` | ``workflows.gpu_check`` | ``tools/gpu_check.py`` | ``mbn-gpu-check`` |
| ``watch_bleu`` | ``commands.watch_bleu`` | ``tools/watch_bleu.py`` | ``mbn-watch-bleu`` |

``local_slurm`` and ``rehearse_slurm`` use the checkout's ``slurm/`` launchers, so they have no
console script.
"""

COMMANDS = {
    "train": "megatron_branchnorm.train",
    "preprocess": "megatron_branchnorm.commands.preprocess",
    "convert": "megatron_branchnorm.commands.convert",
    "translate": "megatron_branchnorm.commands.translate",
    "evaluate": "megatron_branchnorm.commands.evaluate",
    "plan": "megatron_branchnorm.commands.plan",
    "rehearse": "megatron_branchnorm.workflows.rehearse",
    "demo": "megatron_branchnorm.workflows.demo",
    "plot": "megatron_branchnorm.commands.plot",
    "corpus": "megatron_branchnorm.commands.corpus",
    "opus_like": "megatron_branchnorm.commands.opus_like",
    "local_slurm": "megatron_branchnorm.workflows.local_slurm",
    "rehearse_slurm": "megatron_branchnorm.workflows.rehearse_slurm",
    "gpu_check": "megatron_branchnorm.workflows.gpu_check",
    "watch_bleu": "megatron_branchnorm.commands.watch_bleu",
}
"""Each command's name and the module whose ``main`` it runs (``python -m MODULE``)."""
