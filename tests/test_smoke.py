"""`make smoke` (scripts/smoke.py) trains on a real gradient, and a smoke run that does not fails loudly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("smoke_script", REPO / "scripts" / "smoke.py")
smoke = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smoke)
groups_with_variance, main = smoke.groups_with_variance, smoke.main
CACHE = f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}"


def mlflow_metrics(run_dir: Path, key: str) -> list[float]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{run_dir / 'mlflow.db'}")
    run_id = (run_dir / "mlflow_run_id.txt").read_text().strip()
    return [m.value for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


@pytest.mark.slow  # the warm start, about 20 s on 2 cores
def test_the_smoke_recipe_trains_on_groups_with_reward_variance(tmp_path, capfd):
    """configs/smoke.yaml from the script's warm start, one step: some group mixes rewards, so the
    advantages are not all zero and the step's gradient is not zero."""
    run = tmp_path / "run"
    assert main([f"--run.dir={run}", CACHE, "--trainer.threads=1", "--trainer.max_steps=1"]) == 0
    num_varied, num_groups = groups_with_variance(run)
    assert num_groups == 2 and num_varied >= 1
    assert f"smoke: {num_varied} of {num_groups} groups had reward variance" in capfd.readouterr().err
    assert mlflow_metrics(run, "groups/num_zero_variance") == [num_groups - num_varied]
    assert mlflow_metrics(run, "policy/grad_norm")[0] > 0.0
    # resuming the finished run trains nothing: the old batches do not count as this call's gradient
    assert main([f"--run.dir={run}", CACHE, "--trainer.threads=1", "--trainer.max_steps=1", "--run.resume=last"]) == 1
    assert "no step was trained by this call" in capfd.readouterr().err


def test_a_smoke_run_without_reward_variance_exits_with_an_error(tmp_path, capfd):
    """No warm start: the random model never earns a reward, every group is constant, exit status 1."""
    run = tmp_path / "run"
    argv = [f"--run.dir={run}", CACHE, "--warm-start-steps=0", "--trainer.threads=1", "--trainer.max_steps=1",
            "--rollout.group_size=2", "--env.max_turns=1", "--engine.max_new_tokens=16", "--tracking.enabled=false"]
    assert main(argv) == 1
    assert groups_with_variance(run) == (0, 2)
    assert "error: smoke: no group had reward variance" in capfd.readouterr().err


@pytest.mark.parametrize("settings, error", [
    ([f"--env.tasks={REPO / 'tasks' / 'bugfix'}"], "error: env.tasks: the smoke run's warm start needs the copy-the-key suite"),
    (["--env.kind=lightning_agentrl.envs.rooms:RoomsEnv", f"--env.tasks={REPO / 'tasks' / 'rooms' / 'maze.jsonl'}"],
     "error: env.kind: the smoke run's warm start is for the coding environment"),
    ([f"--env.tasks={REPO / 'tasks' / 'rooms' / 'maze.jsonl'}"], "error: env.tasks: "),
])
def test_the_smoke_run_refuses_a_suite_its_warm_start_cannot_demonstrate(tmp_path, capfd, settings, error):
    assert main([f"--run.dir={tmp_path / 'run'}", *settings]) == 2
    assert error in capfd.readouterr().err
    assert not (tmp_path / "run").exists()
