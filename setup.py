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
        "test": [
            "pytest>=8",
            "ruff>=0.5",
            "transformers>=4.44",
            "hypothesis>=6",
            # tests/docs/test_site.py builds the docs site (mkdocs build --strict).
            "mkdocs>=1.6.1",
            "mkdocs-material>=9.8.2",
            # tests/inference/test_ct2.py: CTranslate2 exports against our beam search.
            "ctranslate2>=4.5",
        ],
        "hf": ["transformers>=4.44"],
        # convert_checkpoint.py --format ctranslate2; translate.py / evaluate.py on its exports.
        "ct2": ["ctranslate2>=4.5", "transformers>=4.44"],
        # The docs site: mkdocs serve / mkdocs build (mkdocs.yml at the root).
        "docs": ["mkdocs>=1.6.1", "mkdocs-material>=9.8.2"],
    },
)
