"""The paper's recipes (docs/recipes.md): every config loads, validates and plans to fit on
32 x A100-40GB with the paper's 128 x 4096 tokens per update; the multilingual configs' batches;
the one launcher; the published figures as the paper prints them; the scoring a task gets."""

from __future__ import annotations

import json
import math
import re
import subprocess
from types import SimpleNamespace

import pytest

from megatron_branchnorm.config import CONFIG_DIR, load_config
from megatron_branchnorm.experiments import sweep
from megatron_branchnorm.inference.evaluate import Scoring, choose_scoring
from megatron_branchnorm.paper import (
    DIVERGED,
    TASKS,
    format_cell,
    published,
    task_of_config,
    task_of_data,
)
from megatron_branchnorm.parallel.partition import partition_plan
from megatron_branchnorm.parallel.planner import GB, plan_run
from tests.slurm.conftest import ROOT

PAPER_TOKENS = 128 * 4096
RECIPES = {
    "wmt17_en_de": (6, 18, 50, 100, 250),
    "wmt14_en_fr": (6, 18, 50, 100, 250, 500),
    "iwslt14_de_en": (6, 18),
}
CONFIGS = [f"{task}_{n}L" for task, depths in RECIPES.items() for n in depths]
MULTILINGUAL = {  # config: GPUs of its launcher (or, without one, one node of 8)
    "opus100_12L": 8,
    "opus100_24L": 8,
    "opus100_48L": 8,
    "opus100_200L": 16,
    "opus100_1000L": 32,
    "multiun_12L": 8,
    "multiun_24L": 8,
    "multiun_48L": 8,
    "multiun_200L": 16,
    "multiun_1000L": 32,
}


def test_every_recipe_is_shipped_and_every_shipped_recipe_is_known():
    shipped = {p.stem for p in CONFIG_DIR.glob("*.yaml") if task_of_config(p.stem) in RECIPES}
    assert shipped == set(CONFIGS)
    for task, depths in RECIPES.items():
        assert TASKS[task].depths == depths


@pytest.mark.parametrize("name", CONFIGS)
def test_recipe_loads_validates_and_plans_on_32_a100_40gb(name):
    cfg = load_config(name)
    task = TASKS[task_of_config(name)]
    n = int(re.search(r"_(\d+)L$", name).group(1))
    m, t = cfg.model, cfg.train
    assert (m.encoder_layers, m.decoder_layers) == (n, n)
    assert (m.hidden_size, m.ffn_hidden_size, m.num_attention_heads) == (512, 2048, 8)
    assert (m.residual, m.branchnorm_steps, m.branchnorm_schedule) == ("branchnorm", 4000, "linear")
    assert m.dropout == (0.1 if task.name == "wmt14_en_fr" else 0.4)
    assert (t.lr, t.warmup_steps, t.warmup_init_lr) == (5e-4, 4000, 1e-7)
    assert (t.adam_beta1, t.adam_beta2, t.adam_eps) == (0.9, 0.98, 1e-8)
    assert (t.label_smoothing, t.clip_grad, t.max_steps) == (0.1, 0.0, 100000)
    assert t.weight_decay == 1e-4
    assert (t.patience > 0) == (task.name != "wmt14_en_fr")  # early stopping: small-scale tasks
    assert partition_plan(m, cfg.pipeline.stages, cfg.pipeline.partition)
    plan = plan_run(cfg, 32, 40 * GB, vocab_size=task.vocab_size, config_name=name)
    assert plan.fits(), (name, plan.peak() / GB)
    assert plan.peak() <= 0.95 * 40 * GB  # a margin under the estimate
    assert plan.stages * plan.dp == 32
    assert plan.tokens_per_update == PAPER_TOKENS


@pytest.mark.parametrize("name", sorted(MULTILINGUAL))
def test_multilingual_configs_train_on_the_papers_tokens_per_update(name):
    cfg = load_config(name)
    dp = MULTILINGUAL[name] // cfg.pipeline.stages
    assert cfg.data.max_tokens * cfg.train.micro_batches * dp == PAPER_TOKENS


def test_the_recipe_launcher():
    script = ROOT / "slurm" / "recipe.sh"
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    nodes = int(re.search(r"#SBATCH --nodes=(\d+)", text).group(1))
    per_node = int(re.search(r"#SBATCH --ntasks-per-node=(\d+)", text).group(1))
    assert nodes * per_node == 32 and "#SBATCH --signal=USR1@600" in text
    assert text.rstrip().endswith("mb_launch") and "CONFIG=wmt17_en_de_6L" in text
    # shellcheck: tests/slurm/test_scripts.py checks recipe.sh with every launcher


def test_the_launcher_wants_a_config(tmp_path):
    env = {"PATH": f"{ROOT / '.venv' / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path)}
    env["SLURM_JOB_ID"] = "1"
    proc = subprocess.run(
        ["bash", str(ROOT / "slurm" / "recipe.sh")], cwd=ROOT, env=env, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert proc.returncode == 2 and "set CONFIG to a recipe" in proc.stderr


def test_published_cells_print_as_the_paper_prints_them():
    assert published("wmt17_en_de", "branchnorm", 50) == "30.7"
    assert published("wmt17_en_de", "branchnorm", 6) == "29.x"  # decimals lost: never a number
    assert published("wmt17_en_de", "postln", 18) == DIVERGED == "diverged"
    assert published("wmt17_en_de", "preln", 250) == "27.x"
    assert published("wmt14_en_fr", "branchnorm", 250) == "44.3"
    assert published("wmt14_en_fr", "branchnorm", 100) == "44.2"
    assert published("opus100", "branchnorm", 500) == "32.3"
    assert published("multiun", "branchnorm", 100) == "53.4"
    assert published("iwslt14_de_en", "branchnorm", 6) is None
    assert published("opus100", "postln", 100) is None
    assert [format_cell(v) for v in (28.1, 30, "div", "29.x")] == ["28.1", "30.0", "diverged", "29.x"]  # fmt: skip
    every = [v for t in TASKS.values() for row in t.rows.values() for v in row.values()]
    assert all(re.fullmatch(r"\d\d\.(\d|x)|diverged", v) for v in every), every


def test_sweep_table_beside_the_papers_table_1(tmp_path):
    cells = {}
    for scheme, depth, loss in (("postln", 6, 4.0), ("postln", 18, None), ("branchnorm", 6, 3.5)):
        save_dir = tmp_path / sweep.cell_name(scheme, depth) / "run"
        save_dir.mkdir(parents=True)
        rows = [{"step": 1, "loss": 5.0}]
        rows.append({"step": 2, "valid_loss": loss} if loss else {"step": 2, "loss": math.nan})
        (save_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        cells[sweep.cell_name(scheme, depth)] = {"scheme": scheme, "depth": depth, "save_dir": str(save_dir)}  # fmt: skip
    (tmp_path / sweep.SWEEP_FILE).write_text(json.dumps({"task": "wmt17_en_de", "cells": cells}))
    result = sweep.collect(tmp_path, "valid_loss")
    assert result["task"] == "wmt17_en_de"
    paper, source = sweep.paper_figures(None, result["task"])  # the sweep knows its task
    lines = sweep.format_table(result, paper, source).splitlines()
    assert lines[:4] == [
        "| valid_loss | 6L-6L | paper | 18L-18L | paper |",
        "| --- | ---: | ---: | ---: | ---: |",
        "| postln | 4.000 | 28.1 | diverged | diverged |",
        "| branchnorm | 3.500 | 29.x |  | 30.x |",
    ]
    assert lines[-1].startswith("paper: WMT17 En-De, Table 1 of the BranchNorm paper")
    assert sweep.paper_figures("", "wmt17_en_de")[0] == paper  # --paper alone
    assert sweep.paper_figures("-", "wmt17_en_de") == (None, "")  # --no-paper
    with pytest.raises(sweep.SweepError, match="the sweep has no task"):
        sweep.paper_figures("", None)
    assert sweep.paper_figures("wmt14_en_fr", None)[0]["branchnorm"]["250"] == "44.3"
    with pytest.raises(sweep.SweepError, match="no recipe config wmt17_en_de_7L"):
        sweep.recipe_configs("wmt17_en_de", [6, 7])


def _args(**kw):
    base = dict(bleu=None, tokenize=None, lowercase=False, compound_split=False, task="auto")
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    "directions, languages, task, scoring",
    [
        (["en-de"], ["de", "en"], "wmt17_en_de", Scoring("tokenized", None, False, True)),
        (["en-fr"], ["en", "fr"], "wmt14_en_fr", Scoring("tokenized", None, False, False)),
        (["de-en"], ["de", "en"], "iwslt14_de_en", Scoring("tokenized", None, True, False)),
        (
            ["ar-en", "en-ar"],
            ["ar", "en", "es", "fr", "ru", "zh"],
            "multiun",
            Scoring(lowercase=True),
        ),  # fmt: skip
        (["de-en", "en-de", "en-fr"], ["de", "en", "fr"], "opus100", Scoring()),
        (["fr-de"], ["de", "fr"], None, Scoring()),
    ],
)
def test_evaluation_picks_the_papers_scoring_for_the_task(tmp_path, directions, languages, task, scoring):  # fmt: skip
    manifest = {"directions": directions, "languages": languages, "pivot": "en"}
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    assert task_of_data(manifest)[0] == task
    chosen, how = choose_scoring(_args(), tmp_path)
    assert chosen == scoring and how["task"] == task
    # a flag given by hand wins; --task names the task whatever the data
    assert choose_scoring(_args(bleu="sacrebleu"), tmp_path)[0] == Scoring()
    assert choose_scoring(_args(task="multiun"), tmp_path)[0] == Scoring(lowercase=True)
    assert choose_scoring(_args(task="none"), tmp_path)[0] == Scoring()
