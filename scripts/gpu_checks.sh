#!/usr/bin/env bash
# The GPU checks that fit a short session on one GPU (a few minutes): scripts/gpu_smoke.py (real `fit`
# steps of a random-init model of a recipe's shape, measured against the memory plan) on
#   1. the real model's shape (SmolLM2-135M, configs/learn_real.yaml's episodes), full fine-tuning;
#   2. the same with LoRA rank 8 (model.lora_rank);
#   3. the 1.5B recipe's shape (configs/gpu_zero2.yaml), full fine-tuning;
#   4. the same with LoRA rank 8.
# Each is bounded by its own timeout and a failure does not stop the next; the records go to DIR.
#
#   bash scripts/gpu_checks.sh DIR SMOLLM2_FOLDER     # the folder holds the model's config.json and tokenizer
#                                                     # (the converted .cache/lightning_agentrl/gguf/<hash>/)
#   ONLY=gpu_smollm2_lora8,gpu_zero2_lora8 bash scripts/gpu_checks.sh ...   # some of them
set -uo pipefail
cd "$(dirname "$0")/.."
DIR=${1:?usage: gpu_checks.sh DIR SMOLLM2_FOLDER}
SMOL=${2:?usage: gpu_checks.sh DIR SMOLLM2_FOLDER}
PY=${PYTHON:-python3}
mkdir -p "$DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
status=0
smoke() {  # NAME TIMEOUT ARGS...
  local name=$1 limit=$2; shift 2
  [[ -z ${ONLY:-} || ,$ONLY, == *",$name,"* ]] || return 0
  echo "== $name"
  local started=$SECONDS
  timeout "$limit" "$PY" scripts/gpu_smoke.py "$@" --out "$DIR/$name.json" >"$DIR/$name.log" 2>&1
  local code=$?
  echo "   exit $code after $((SECONDS - started)) s"
  tail -n 3 "$DIR/$name.log"
  [[ $code -eq 0 ]] || status=1
}
REAL=(--recipe configs/learn_real.yaml --model-config "$SMOL/config.json" --tokenizer "$SMOL" --dtype bfloat16
      --steps 6 --episodes 16 --max-turns 4 --max-new-tokens 48 --max-context-tokens 1024 --micro-batch-tokens 8192)
smoke gpu_smollm2_full 150 "${REAL[@]}"
smoke gpu_smollm2_lora8 150 "${REAL[@]}" --lora-rank 8
smoke gpu_zero2_shape 240 --recipe configs/gpu_zero2.yaml --steps 3
smoke gpu_zero2_lora8 240 --recipe configs/gpu_zero2.yaml --steps 3 --lora-rank 8
exit $status
