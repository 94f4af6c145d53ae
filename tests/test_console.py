"""What ``fit`` prints: a progress bar in rollout steps, and none of the library lines a user cannot act on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.fitting import REPO
from tests.test_keydoor import MAP


def test_fit_shows_steps_episodes_tokens_and_reward_and_no_library_noise(tmp_path):
    tasks = tmp_path / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    done = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "tests/fixtures/tiny_bugfix.yaml",
         "--env.kind=keydoor", f"--env.tasks={tasks}", "--env.split=all", f"--run.dir={tmp_path / 'run'}",
         "--trainer.threads=1", "--trainer.max_steps=2", "--engine.max_new_tokens=16", "--env.max_turns=2",
         "--model.tiny_hidden_size=64", "--model.tiny_num_layers=1"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, capture_output=True, text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    bar = [line for line in done.stdout.splitlines() if line.startswith("step ")]
    assert len(bar) == 1, done.stdout
    assert " 2/2 " in bar[0] and "episodes: 16 done, 0 in flight" in bar[0] and "reward: 0.000" in bar[0], bar
    assert float(bar[0].split("tokens/s: ")[1].split()[0]) > 0
    output = done.stdout + done.stderr
    for noise in ("Epoch 0/-2", "it/s", "v_num", "litlogger", "LeafSpec", "Setting accelerator to CPU",
                  "Loading weights", "Writing model shards", "Creating initial MLflow database tables"):
        assert noise not in output, (noise, output[-3000:])
    assert "Setting accelerator" not in done.stdout  # DeepSpeed's warning went to stdout, after the run


@pytest.mark.slow
@pytest.mark.vllm
def test_the_in_process_vllm_engine_logs_errors_only(tmp_path, tiny_model_path):
    pytest.importorskip("vllm")
    tasks = tmp_path / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    done = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl", "evaluate", str(tiny_model_path), "--split", "all", "--samples", "1",
         "--env.kind=keydoor", f"--env.tasks={tasks}", "--engine.kind=vllm", "--engine.max_new_tokens=16",
         "--env.max_turns=2", "--trainer.threads=1"],
        cwd=REPO, env={**env, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "  ended       max_turns 2" in done.stdout.splitlines()
    logged = [line for line in output.splitlines() if " INFO " in line or " WARNING " in line]
    assert not logged, logged  # about 50 such lines before
