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
def kill_when(command: list[str], env: dict, written: Path) -> None:
    """Start ``command`` and SIGKILL it as soon as ``written`` exists (it must still be running)."""
    process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 600
    while not written.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, "the run ended before it could be killed"
    process.send_signal(signal.SIGKILL)
    process.wait()


@pytest.mark.parametrize("lora", [[], ["--model.lora_rank=8"]], ids=["full", "lora"])
def test_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, tiny_model_path, lora):
    tasks = tmp_path / "tasks"
    for name in ("binary_search_first", "balanced_brackets_unclosed"):
        shutil.copytree(REPO / "tasks" / "bugfix" / name, tasks / name)
    command = [
        sys.executable, "-m", "lightning_agentrl", "fit", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"),
        f"--env.tasks={tasks}", "--env.split=all", f"--model.cache_dir={tiny_model_path.parent}",
        "--trainer.max_steps=4", "--algorithm.entropy_coef=0.01", "--trainer.lr=1e-3",
        "--engine.max_new_tokens=24", "--env.max_turns=2", "--trainer.threads=1", *lora,
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    straight = tmp_path / "straight"
    done = subprocess.run([*command, f"--run.dir={straight}"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    killed = tmp_path / "killed"
    # step 2's trajectories are written after the checkpoint of the step before
    kill_when([*command, f"--run.dir={killed}"], env, killed / "trajectories" / "step_000002.jsonl")

    resumed = subprocess.run([*command, f"--run.dir={killed}", "--resume", "last"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected, got = losses(straight), losses(killed)
    assert sorted(expected) == [0, 1, 2, 3]
    for step in (2, 3):  # the steps after the kill
        assert got[step] == pytest.approx(expected[step], abs=1e-6), (step, got, expected)
    assert expected[3] != 0.0


@pytest.mark.slow
def test_async_run_killed_and_resumed_trains_no_group_twice_and_loses_none(tmp_path, tiny_model_path):
    """max_staleness=1: groups are generated a step ahead. A SIGKILL after a checkpoint, then a resume:
    no group of the run is trained twice or lost with the killed process, and every action of step k was
    sampled by weights of version k-1 or k."""
    from lightning_agentrl.trajectory import load_trajectories

    tasks = tmp_path / "tasks"
    for name in ("binary_search_first", "balanced_brackets_unclosed"):
        shutil.copytree(REPO / "tasks" / "bugfix" / name, tasks / name)
    run = tmp_path / "run"
    command = [
        sys.executable, "-m", "lightning_agentrl", "fit", "--config", str(REPO / "tests" / "fixtures" / "tiny_bugfix.yaml"),
        f"--env.tasks={tasks}", "--env.split=all", f"--model.cache_dir={tiny_model_path.parent}",
        "--trainer.max_steps=4", "--rollout.max_staleness=1", "--rollout.group_size=2", "--rollout.max_in_flight=4",
        "--engine.max_new_tokens=24", "--env.max_turns=2", "--trainer.threads=1", "--tracking.enabled=false",
        "--model.tiny_hidden_size=64", "--model.tiny_num_layers=1", f"--run.dir={run}",
    ]
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
    kill_when(command, env, run / "trajectories" / "step_000002.jsonl")  # written once step 1's checkpoint is saved
    resumed = subprocess.run([*command, "--resume", "last"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    trained: list[int] = []
    for step in range(4):  # the batches trained at each step (a killed attempt's are kept aside as superseded_*)
        for trajectory in load_trajectories(run / "trajectories" / f"step_{step:06d}.jsonl"):
            trained.append(trajectory.group_id)
            versions = {v for segment in trajectory.segments for v, m in
                        zip(segment.policy_versions, segment.loss_mask, strict=True) if m}
            assert versions and step - 1 <= min(versions) and max(versions) <= step, (step, versions)
    groups = set(trained)
    assert len(trained) == 2 * len(groups) and len(groups) == 8  # each group's 2 episodes, once; 2 groups a step
    # The buffer hands out groups in the order they finish, so a group may train after one started later
    # than it (or after the run's last step). None is lost: every group the service started was trained,
    # dropped as stale (counted), or is held by the last checkpoint (running or ready) for a resume.
    import torch

    checkpoint = torch.load(run / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    state = checkpoint["RolloutDataModule"]["services"][0]
    held = ({*state["restart"], *map(int, state["groups"])}
            | {group[0]["group_id"] for group in state["buffer"]["ready"]})
    started = set(range(state["next_group"]))
    assert not held & groups and groups | held <= started, (sorted(groups), sorted(held), state["next_group"])
    assert len(started - groups - held) == state["buffer"]["num_dropped_stale"], (sorted(groups), sorted(held))
