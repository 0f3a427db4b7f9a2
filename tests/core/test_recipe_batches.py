"""Every shipped recipe that names the paper's batch in its comments keeps it at every GPU
count the layout accepts (training/layout.choose_layout, as the trainer plans), and a count
that cannot share it is refused in one line naming the GPU counts that keep it."""

from __future__ import annotations

import re

import pytest

from megatron_branchnorm.config import CONFIG_DIR, ConfigError, load_config
from megatron_branchnorm.parallel.planner import GB
from megatron_branchnorm.training.layout import Device, choose_layout

BATCH = re.compile(r"^\s*#.*the paper's (\d+) x (\d+)\b", re.MULTILINE)
GPU_COUNTS = (8, 12, 16, 24, 32, 64)
A100_40GB = Device(memory=40 * GB, overhead=3 * 2**30)


def _named_batches() -> dict[str, int]:
    """recipe: the tokens per update its comments name (the paper's micro-batches x tokens)."""
    named = {}
    for path in sorted(CONFIG_DIR.glob("*.yaml")):
        found = BATCH.search(path.read_text(encoding="utf-8"))
        if found:
            named[path.stem] = int(found.group(1)) * int(found.group(2))
    return named


NAMED = _named_batches()


def test_the_recipes_that_name_a_batch_are_found():
    assert len(NAMED) >= 20 and set(NAMED.values()) == {128 * 4096}
    assert {"wmt17_en_de_100L", "iwslt14_de_en_6L", "opus100_12L", "multiun_1000L"} <= set(NAMED)


@pytest.mark.parametrize("name", sorted(NAMED))
def test_every_accepted_gpu_count_trains_the_named_batch(name):
    cfg = load_config(name)
    accepted = []
    for world in GPU_COUNTS:
        try:
            layout = choose_layout(cfg, world, A100_40GB, None)
        except ConfigError as exc:
            line = str(exc)
            assert "\n" not in line and "GPU counts that keep 128 micro-batches per update" in line
            counts = re.search(r"GPU counts that keep \d+ micro-batches per update at "
                               r"pipeline\.stages=\d+: ([\d, ]+)", line)  # fmt: skip
            assert counts, line
            assert str(world) not in counts.group(1).split(", ")
            assert "32" in counts.group(1).split(", ") or cfg.pipeline.stages > 2
            continue
        accepted.append(world)
        assert layout.stages * layout.data_parallel == world
        tokens = layout.data_parallel * layout.micro_batches * cfg.data.max_tokens
        assert tokens == NAMED[name], (name, world, layout)
    assert 32 in accepted or cfg.pipeline.fallback_stages  # the paper's 32 GPUs


def test_wmt17_100L_on_12_gpus_is_refused_naming_the_counts():
    """12 replicas cannot share 128 micro-batches (before: 12 x 4 x 4,096 = 196,608 tokens per
    update, under the header's 524,288, without a word)."""
    with pytest.raises(ConfigError) as exc:
        choose_layout(load_config("wmt17_en_de_100L"), 12, A100_40GB, None)
    line = str(exc.value)
    assert "its data-parallel size 12 does not divide the config's 128 micro-batches" in line
    assert "at pipeline.stages=1: 1, 2, 4, 8, 16, 32, 64, 128;" in line
