#!/usr/bin/env bash
# GPU smoke run (minutes): a few `fit` steps of a recipe's model shape, random-init, on one GPU;
# writes benchmarks/results/gpu/gpu_smoke.json (tokens/s, peak memory, the memory plan's prediction).
#
#   bash scripts/gpu_smoke.sh [configs/gpu_zero2.yaml] [--tokenizer DIR] [--steps 3] ...
#
# Needs a CUDA torch, lightning and transformers, as preinstalled on GPU machines; not vLLM,
# DeepSpeed or MLflow. The project's small pure-Python dependencies (pydantic-settings, fastapi,
# uvicorn, rich, ...) are installed from $WHEELS when missing (no network needed); prepare that
# folder on a machine with an index: bash scripts/gpu_smoke_wheels.sh <python version, e.g. 3.12>.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
WHEELS=${WHEELS:-.cache/gpu_wheels}
RECIPE=configs/gpu_zero2.yaml
if [[ $# -gt 0 && $1 != --* ]]; then RECIPE=$1; shift; fi

"$PY" - <<'PYEOF'
import torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
PYEOF

missing=$("$PY" - <<'PYEOF'
import importlib.util
modules = {"pydantic": "pydantic", "pydantic_settings": "pydantic-settings", "yaml": "pyyaml",
           "httpx2": "httpx2", "rich": "rich", "fastapi": "fastapi", "uvicorn": "uvicorn",
           "safetensors": "safetensors", "lightning": "lightning", "transformers": "transformers"}
print(" ".join(pkg for mod, pkg in modules.items() if importlib.util.find_spec(mod) is None))
PYEOF
)
if [[ -n "$missing" ]]; then
  if [[ ! -d "$WHEELS" ]]; then
    echo "missing: $missing; no wheel folder at $WHEELS (bash scripts/gpu_smoke_wheels.sh PYVER)" >&2
    exit 2
  fi
  echo "installing from $WHEELS: $missing"
  "$PY" -m pip install --quiet --no-index --find-links "$WHEELS" $missing
fi

mkdir -p benchmarks/results/gpu
"$PY" scripts/gpu_smoke.py --recipe "$RECIPE" "$@"
