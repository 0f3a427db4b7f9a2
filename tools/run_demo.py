#!/usr/bin/env python
"""Run the main job end to end on the built-in corpus (what `make demo` does).

    python tools/run_demo.py --out runs/demo --langs de,fr --minutes 15
    python tools/run_demo.py --out runs/demo24 --layers 24 --minutes 20

Builds the English-centric locale corpus, preprocesses it, trains the demo_cpu config through
the 2-stage DeepSpeed pipeline on 2 CPU ranks for --minutes (with an early checkpoint), converts
and evaluates both checkpoints with beam search and sacreBLEU, and writes OUT/report.md and
OUT/plots/training.png. See docs/demo.md.
"""

from megatron_branchnorm.commands.demo import main

if __name__ == "__main__":
    raise SystemExit(main())
