#!/usr/bin/env bash
# Build a wheelhouse of what this project needs beyond torch, for a GPU machine without a
# network (tools/gpu_check.py there). Run on a networked machine with the same Python
# version and CPU architecture as the GPU machine, from the checkout, after `make venv`:
#
#     bash tools/build_wheelhouse.sh [DIR]          # default: wheelhouse/ (git-ignored)
#     TARGET_PYTHON=3.12 bash tools/build_wheelhouse.sh   # binary wheels for another CPython
#                                                         # (the lent H100 has 3.12)
#
# and on the GPU machine, whose torch is already installed (copy DIR there, e.g. as a
# device tool's carried folder: it stays under 64 MiB), tools/device_run.sh installs from it
# the wheels that machine's interpreter lacks into a folder on PYTHONPATH (never over its own
# torch or numpy) and runs the measurements; by hand, the same:
#
#     python -m pip install --no-index --no-deps --target SITE DIR/<the wheels it lacks>
#     PYTHONPATH=SITE:. python tools/gpu_check.py
#
# The list is this venv's packages less torch and what torch brings (its CUDA/triton
# companions, sympy, networkx, jinja2...; typing_extensions is kept: the pins here may want a
# newer one than the device's torch brought), less what only the tests use, and less matplotlib
# and TensorBoard with their dependencies (~45 MB: the plotting tools need matplotlib; the
# trainer runs without TensorBoard and says so), less CTranslate2 (~40 MB: the optional fast
# inference engine) and the docs site's MkDocs family. DeepSpeed comes from PyPI as source and is
# built here into a pure-Python wheel (its CUDA ops compile just in time on the GPU machine,
# as they would anyway).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-wheelhouse}
py=${PYTHON:-.venv/bin/python}
"$py" -m pip --version > /dev/null || { echo "error: $py has no pip (run make venv)" >&2; exit 2; }
mkdir -p "$dir"
reqs=$(mktemp)
trap 'rm -f "$reqs"' EXIT
"$py" -m pip freeze --exclude-editable \
    | grep -viE '^(torch|triton|nvidia-[a-z0-9-]+|sympy|mpmath|networkx|jinja2|markupsafe|filelock|fsspec)==' \
    | grep -viE '^(pytest|iniconfig|pluggy|ruff|hypothesis|sortedcontainers|transformers|tokenizers|huggingface[-_]hub|hf[-_]xet|deepspeed)==' \
    | grep -viE '^(matplotlib|pillow|fonttools|kiwisolver|contourpy|cycler|pyparsing|python[-_]dateutil|six)==' \
    | grep -viE '^(tensorboard|tensorboard[-_]data[-_]server|grpcio|protobuf|absl[-_]py|markdown|werkzeug)==' \
    | grep -viE '^(ctranslate2|mkdocs[-_a-z]*|pymdown[-_]extensions|babel|paginate|backrefs|ghp[-_]import|mergedeep|pathspec|pyyaml[-_]env[-_]tag|watchdog|platformdirs)==' \
    > "$reqs"
# Binary wheels for this interpreter, or for CPython $TARGET_PYTHON on x86-64 Linux: the same
# pinned versions, the ABI of the machine that will install them.
target=()
if [ -n "${TARGET_PYTHON:-}" ]; then
    abi="cp${TARGET_PYTHON/./}"
    target=(--python-version "$TARGET_PYTHON" --implementation cp --abi "$abi" --abi abi3
            --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64
            --platform manylinux_2_28_x86_64 --platform linux_x86_64 --platform any)
fi
"$py" -m pip download --quiet --no-deps --only-binary=:all: "${target[@]}" -r "$reqs" -d "$dir"
ds=$("$py" -c 'from importlib.metadata import version; print(version("deepspeed"))')
DS_BUILD_OPS=0 "$py" -m pip wheel --quiet --no-deps --no-build-isolation "deepspeed==$ds" -w "$dir"
"$py" -m pip download --quiet --no-deps --only-binary=:all: "${target[@]}" setuptools wheel -d "$dir"
# make gpu-bench's torchscale row (pure Python; installed with --no-deps: its timm pin needs
# torchvision, and gpu_bench registers a stand-in timm); tools/device_run.sh installs them too
"$py" -m pip download --quiet --no-deps --only-binary=:all: torchscale==0.3.0 -d "$dir/anchors"
"$py" -m pip wheel --quiet --no-deps --no-build-isolation fairscale==0.4.0 -w "$dir/anchors"
echo "$dir: $(ls "$dir" | wc -l) wheels, $(du -sh "$dir" | cut -f1)"
