"""The inference side imports without DeepSpeed: converting, exporting and translating need the
stage plan and its key maps (partition.py), never the pipeline adapter (docs/design.md §9)."""

import subprocess
import sys

import pytest

MODULES = (
    "megatron_branchnorm.parallel.partition",
    "megatron_branchnorm.model",
    "megatron_branchnorm.inference.convert",
    "megatron_branchnorm.inference.export",
    "megatron_branchnorm.inference.translate",
    "megatron_branchnorm.inference.evaluate",
    "megatron_branchnorm.inference.hf_export",
)


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", MODULES)
def test_imports_with_deepspeed_unimportable(module):
    # None in sys.modules makes every `import deepspeed` (and deepspeed.x) raise ImportError
    result = _run(f"import sys\nsys.modules['deepspeed'] = None\nimport {module}\n")
    assert result.returncode == 0, result.stderr


def test_convert_and_translate_do_not_load_deepspeed():
    code = (
        "import sys\n"
        "import megatron_branchnorm.inference.convert, megatron_branchnorm.inference.translate\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'deepspeed'))\n"
    )
    result = _run(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_key_maps():
    from megatron_branchnorm.config import load_config
    from megatron_branchnorm.parallel.partition import engine_param_to_flat_key, spec_names

    names = spec_names(load_config("tiny_cpu").model)
    last = max(names)
    assert engine_param_to_flat_key("tied_modules.embed.embedding.weight", names) == (
        "embedding.weight"
    )
    assert engine_param_to_flat_key("1.ffn.fc1.weight", names) == "encoder_layers.0.ffn.fc1.weight"
    enc_final = next(i for i, n in names.items() if n == "encoder_final_norm")
    assert engine_param_to_flat_key(f"{enc_final}.norm.weight", names) == (
        "encoder_final_norm.weight"
    )
    with pytest.raises(KeyError):
        engine_param_to_flat_key(f"{last + 1}.norm.weight", names)
