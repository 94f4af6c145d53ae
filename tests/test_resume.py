"""Exact resume: a run killed with SIGKILL mid-training and continued with --resume last takes the
same next steps as a run that was never interrupted (deterministic sampling, same tasks)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def losses(run_dir: Path) -> dict[int, float]:
    """The last logged total loss of every step of the run's MLflow run."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    history = sorted(client.get_metric_history(run_id, "loss/total"), key=lambda m: m.timestamp)
    return {m.step: m.value for m in history}


@pytest.mark.slow
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_path):
    tasks = tmp_path / "tasks"
    for name in ("binary_search_first", "balanced_brackets_unclosed"):
        shutil.copytree(REPO / "tasks" / "bugfix" / name, tasks / name)
    command = [
        sys.executable, "-m", "lightning_agentrl", "fit", "--config", str(REPO / "configs" / "smoke.yaml"),
        f"--env.tasks={tasks}", "--env.split=all", f"--model.cache_dir={tiny_model_path.parent}",
        "--trainer.max_steps=4", "--algorithm.entropy_coef=0.01", "--trainer.lr=1e-3",
        "--engine.max_new_tokens=24", "--env.max_turns=2", "--trainer.threads=1",
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    straight = tmp_path / "straight"
    done = subprocess.run([*command, f"--run.dir={straight}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = tmp_path / "killed"
    process = subprocess.Popen([*command, f"--run.dir={killed}"], cwd=REPO, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    third_batch = killed / "trajectories" / "step_000002.jsonl"  # written once step 2's checkpoint is saved
    deadline = time.monotonic() + 600
    while not third_batch.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()

    resumed = subprocess.run([*command, f"--run.dir={killed}", "--resume", "last"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = losses(straight), losses(killed)
    assert sorted(expected) == [0, 1, 2, 3]
    for step in (2, 3):  # the steps after the kill
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)
    assert expected[3] != 0.0
