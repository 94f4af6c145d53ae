"""scripts/gpu_smoke.py runs end to end: here on CPU with a tiny shape (--cpu), on GPUs for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def test_gpu_smoke_shell_script_parses():
    for script in ("gpu_smoke.sh", "gpu_smoke_wheels.sh"):
        subprocess.run(["bash", "-n", str(REPO / "scripts" / script)], check=True)


@pytest.mark.slow
def test_gpu_smoke_script_runs_fit_and_writes_the_plan_beside_the_measurement(tmp_path):
    out = tmp_path / "gpu_smoke.json"
    command = [
        sys.executable, str(REPO / "scripts" / "gpu_smoke.py"), "--cpu",
        "--model-config", str(REPO / "tests" / "fixtures" / "tiny-llama" / "config.json"),
        "--steps", "2", "--episodes", "4", "--max-turns", "2", "--max-new-tokens", "16",
        "--max-context-tokens", "1024", "--micro-batch-tokens", "1024", "--out", str(out),
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["steps"]) == 2
    assert result["train_tokens_per_s"] > 0
    assert result["num_parameters"] == 344_384  # 2 * (64*64*4 + 3*64*128 + 2*64) + 2 * 2048*64 + 64
    assert result["settings"]["engine"]["kind"] == "torch"
    assert result["commit"] and result["config"] == "configs/gpu_zero2.yaml"  # through write_record
    assert result["overrides"]["trainer"]["max_steps"] == 2 and result["seed"] is None
    assert result["settings"]["tracking"]["enabled"] is False
    assert result["settings"]["trainer"]["strategy"] == "auto"
    plan = result["plan"]
    assert plan["torch_engine_copy_on_gpu_bytes"] == 2 * 344_384  # bf16, as the recipe says
    largest = max(step["largest_micro_batch"] for step in result["steps"])
    assert plan["at_largest_micro_batch"]["parts"]["activations"]["gpu_bytes"] < plan["at_micro_batch_tokens"][
        "parts"]["activations"]["gpu_bytes"] or largest >= 1024
