#!/usr/bin/env bash
# Download the small dependencies that a preinstalled GPU stack (torch, lightning,
# transformers, httpx) lacks, as wheels for an offline install by scripts/gpu_smoke.sh, at the
# versions constraints.txt allows (those the tests run with).
#
#   bash scripts/gpu_smoke_wheels.sh 3.12 [.cache/gpu_wheels]      # the GPU machine's Python version
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER=${1:?usage: gpu_smoke_wheels.sh PYTHON_VERSION [DIR]}
DIR=${2:-.cache/gpu_wheels}
mkdir -p "$DIR"
python3 -m pip download --quiet --only-binary=:all: --implementation cp --python-version "$PYVER" \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -c constraints.txt -d "$DIR" pydantic pydantic-settings pyyaml rich fastapi uvicorn httpx2
du -sh "$DIR"
