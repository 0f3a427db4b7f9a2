"""fairseq 0.12.2 side by side with our Post-LN and BranchNorm: the same corpus, the same
vocabulary, the same model and schedule, the same wall-clock training budget; BLEU and chrF per
direction.

Front door: `python tools/fairseq_side_by_side.py --help` gives the usage; the code is
megatron_branchnorm/experiments/fairseq_side_by_side.py.
"""

from megatron_branchnorm.experiments.fairseq_side_by_side import main

if __name__ == "__main__":
    raise SystemExit(main())
