"""fairseq 0.12.2 side by side with our Post-LN and BranchNorm: the same corpus, the same
vocabulary, the same model and schedule, the same wall-clock training budget; BLEU and chrF per
direction.

    python tools/fairseq_side_by_side.py --out runs/side --minutes 20
    python tools/fairseq_side_by_side.py --out runs/side --minutes 20 --reuse branchnorm=runs/demo
    python tools/fairseq_side_by_side.py --out runs/side --report-only

The logic lives in megatron_branchnorm/experiments/fairseq_side_by_side.py.
"""

from megatron_branchnorm.experiments.fairseq_side_by_side import main

if __name__ == "__main__":
    raise SystemExit(main())
