from setuptools import find_packages, setup

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
        "console_scripts": [
            "mbn-train=megatron_branchnorm.train:console_main",
            "mbn-preprocess=megatron_branchnorm.commands.preprocess:main",
            "mbn-convert=megatron_branchnorm.commands.convert:main",
            "mbn-translate=megatron_branchnorm.commands.translate:main",
            "mbn-evaluate=megatron_branchnorm.commands.evaluate:main",
            "mbn-plan=megatron_branchnorm.commands.plan:main",
            "mbn-rehearse=megatron_branchnorm.workflows.rehearse:main",
            "mbn-demo=megatron_branchnorm.workflows.demo:main",
            "mbn-plot=megatron_branchnorm.commands.plot:main",
            "mbn-corpus=megatron_branchnorm.commands.corpus:main",
            "mbn-gpu-check=megatron_branchnorm.workflows.gpu_check:main",
            "mbn-gpu-bench=megatron_branchnorm.experiments.gpu_bench:main",
            "mbn-watch-bleu=megatron_branchnorm.commands.watch_bleu:main",
        ]
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
