"""The `gpu` extra pins a vLLM release together with the torch release it requires, so it resolves.

The resolve itself needs a package index and takes minutes, so it runs only when asked:
``AGENTRL_CHECK_GPU_RESOLVE=1 pytest tests/test_gpu_extra.py``. Measured 2026-11-30: vllm 0.33.0
requires torch==2.14.0; the dry run picks torch 2.14.0, vllm 0.33.0, deepspeed 0.19.8.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def gpu_pins() -> dict[str, str]:
    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    return dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", req).groups() for req in extra if "==" in req)


def test_gpu_extra_pins_vllm_and_its_torch_together():
    pins = gpu_pins()
    assert pins == {"vllm": "0.33.0", "torch": "2.14.0"}
    # the CPU install's torch pin must not be applied to the GPU install (different builds)
    cpu_pin = re.search(r"^torch==(\S+)", (REPO / "constraints.txt").read_text(), re.M).group(1)
    assert cpu_pin != pins["torch"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("AGENTRL_CHECK_GPU_RESOLVE") != "1", reason="needs a package index; opt in")
def test_gpu_extra_resolves_with_pip_dry_run(tmp_path):
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
         "--report", str(report), f"{REPO}[gpu]"],
        capture_output=True, text=True, timeout=1800,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    chosen = {item["metadata"]["name"].lower(): item["metadata"]["version"] for item in json.loads(report.read_text())["install"]}
    for name, version in gpu_pins().items():
        assert chosen[name] == version
