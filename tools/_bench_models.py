"""The model-step benchmark: the same configuration built by each implementation, and one
training-step loop shared by all of them (forward, the same label-smoothed loss, backward, a
plain ``torch.optim.Adam`` step), so a comparison compares models.

Front door: `python tools/_bench_models.py --help` gives the usage; the code is
megatron_branchnorm/experiments/bench_models.py.
"""

from megatron_branchnorm.experiments.bench_models import main

if __name__ == "__main__":
    main()
