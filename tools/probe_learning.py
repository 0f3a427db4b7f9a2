"""How fast does a setting learn to translate? Train the flat model (one process, CPU or GPU)
for a number of updates per variant of a config, and follow the validation NLL, how much the
source is worth (NLL with the sources shuffled minus NLL with the true source) and, at the end,
BLEU/chrF by beam search on the first test sentences of every direction.

The batches, the loss normalisation, AdamW, the inverse-sqrt schedule, BranchNorm's t and
gradient clipping are the trainer's; only the pipeline is left out (it computes the same loss
and gradients: tests/pipeline). Updates are what a CPU budget buys, so a variant that learns
in fewer updates (at the same tokens per update) learns in less time; use it to choose demo
settings (docs/demo.md), on a GPU when one is at hand:

    python tools/probe_learning.py --config demo_cpu --data runs/demo/data --updates 1500         --variant base= --variant lr3e-3=train.lr=3e-3         --variant postln=model.residual=postln --jobs 2 --output probe.jsonl

The logic lives in megatron_branchnorm/experiments/probe_learning.py.
"""

import sys

from megatron_branchnorm.experiments.probe_learning import main

if __name__ == "__main__":
    sys.exit(main())
