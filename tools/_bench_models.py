"""The model-step benchmark: the same configuration built by each implementation, and one
training-step loop shared by all of them (forward, the same label-smoothed loss, backward,
a plain ``torch.optim.Adam`` step), so a comparison compares models.

Imports only torch at module level: it runs both in the project's environment (``ours``,
``torch``) and in the anchors' throwaway environment (``fairseq``, ``torchscale``; see
_bench_anchors.py). As a worker it serves timing requests over stdin/stdout (JSON lines), so
one orchestrator can interleave implementations and repeats in one run:

    python tools/_bench_models.py --impl torch --layers 12     # then {"dtype": "fp32", "steps": 3}

The logic lives in megatron_branchnorm/experiments/bench_models.py.
"""

from megatron_branchnorm.experiments.bench_models import main

if __name__ == "__main__":
    main()
