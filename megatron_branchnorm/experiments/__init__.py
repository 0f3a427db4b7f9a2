"""The research harness: studies, side-by-side comparisons and benchmarks behind docs/. Each
module's ``main`` is the command line of its front door in ``tools/`` (same name; the bench
helpers' front doors carry a leading underscore), and ``python -m
megatron_branchnorm.experiments.NAME`` runs it too.

- ``depth_study``: the four residual schemes at increasing depth, a DeepSpeed pipeline run per
  cell (BranchNorm paper, Fig. 3).
- ``probe_learning``: how fast a setting learns to translate (flat model, one process).
- ``fairseq_side_by_side``: fairseq 0.12.2 against our Post-LN and BranchNorm on the same data
  and budget.
- ``benchmark``: performance against fairseq, torchscale and torch.nn.Transformer, and our
  training step, pipeline, deep model, beam search and preprocessing.
- ``bench_models``: the model-step worker shared by every implementation (torch-only imports).
- ``bench_anchors``: the throwaway environment holding fairseq and torchscale.
- ``bench_micro``: micro-benchmarks and profiles behind docs/performance.md.
- ``bench_pipeline_shapes``: DeepSpeed's dynamic shapes against bucketed batch shapes.
- ``fault_sweep``: long fault-injection runs behind docs/reliability.md.
- ``fault_runs``: the fault launcher and readers shared by the sweep and tests/faults.
- ``analyze_model``: layer-wise analyses of exports (BranchNorm paper, Figs. 8 and 9).
- ``analysis``: the measurements behind ``analyze_model`` and ``source_dependence`` (also the
  demo's source-use figures).
- ``source_dependence``: how much an exported model reads its source.
- ``sweep``: a depth-by-scheme grid submitted to SLURM, collected into the paper's table layout.
- ``compare_metrics``: whether two runs' metrics.jsonl hold the same rows, timings left out
  (``tools/compare_metrics.py``, ``tools/same_runs.sh``).
"""
