import runpy
from pathlib import Path

from setuptools import find_packages, setup

# The console scripts come from the one registry of front doors, FRONT_DOORS in
# megatron_branchnorm/commands/__init__.py, read by path: it needs only the standard library,
# so building needs none of the package's dependencies (tests/core/test_front_doors.py).
_REGISTRY = runpy.run_path(
    str(Path(__file__).resolve().parent / "megatron_branchnorm" / "commands" / "__init__.py")
)

setup(
    name="megatron_branchnorm",
    version="0.1.0",
    description=(
        "Extremely deep encoder-decoder Transformers with BranchNorm on DeepSpeed pipeline "
        "parallelism, for multilingual machine translation"
    ),
    packages=find_packages(include=["megatron_branchnorm", "megatron_branchnorm.*"]),
    # The shipped configs: --config NAME and train.deepspeed_config=ds_configs/NAME.json find
    # them inside the package (config.CONFIG_DIR, resources.find_ds_config).
    package_data={
        "megatron_branchnorm": ["configs/*.yaml", "ds_configs/*.json", "ds_configs/README.md"]
    },
    entry_points={
        "console_scripts": _REGISTRY["console_scripts"](),
    },
    python_requires=">=3.10",
    install_requires=[
        # >= 2.6: torch.load(weights_only=True) is the safe default there.
        "torch>=2.6",
        # The pipeline adapter overrides PipelineModule._partition_layers (docs/design.md §1, §2).
        "deepspeed>=0.19.8,<0.20",
        "sentencepiece>=0.2",
        "sacrebleu>=2.4",
        # Moses tokenisation for the tokenized BLEU of the WMT papers (evaluate.py --bleu).
        "sacremoses>=0.1",
        "pyyaml>=6.0",
        "safetensors>=0.4",
        "tqdm>=4.66",
        # preprocess_data.py --stats: resident memory of the process and its workers.
        "psutil>=5.9",
        "tensorboard>=2.15",
        "numpy>=1.24",
        "matplotlib>=3.7",
    ],
    extras_require={
        "test": ["pytest>=8", "ruff>=0.5", "transformers>=4.44", "hypothesis>=6"],
        "hf": ["transformers>=4.44"],
    },
)
