"""Stage timings through ``fit``: every step's stages, throughput and turn timings, in the MLflow store."""

from __future__ import annotations

import pytest

from tests.fitting import SOLVE, learn_settings, scripted_fit

TRAINER_STAGES = ["time/wait_rollouts_s", "time/forward_backward_s", "time/optimizer_s", "time/weight_sync_s",
                  "time/checkpoint_s"]
ROLLOUT_STAGES = ["time/generation_s", "time/environment_s", "time/scoring_s"]


def test_every_step_logs_its_stage_timings_and_they_fit_in_the_step(tmp_path):
    import lightning as L
    from mlflow.tracking import MlflowClient

    class Trajectories(L.Callback):
        def __init__(self) -> None:
            self.trajectories = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.trajectories.extend(batch.trajectories)

    kept = Trajectories()
    # max_steps 3, a checkpoint every 2 steps: the second batch (logged at step 1) saves, the first and third do
    # not (the third's is after training)
    settings = learn_settings(tmp_path, "--trainer.max_steps=3", "--trainer.checkpoint_every=2",
                              "--tracking.enabled=true", "--env.max_turns=3")
    result, _ = scripted_fit(settings, {"e0": SOLVE}, callbacks=[kept])
    client = MlflowClient(tracking_uri=result.tracking_uri)

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(result.mlflow_run_id, key)}

    step_s = history("time/step_s")
    assert sorted(step_s) == [0, 1, 2] and all(v > 0 for v in step_s.values())
    for key in ["time/wait_rollouts_s", "time/forward_backward_s", "time/optimizer_s", *ROLLOUT_STAGES,
                "throughput/tokens_per_s"]:
        values = history(key)
        assert sorted(values) == [0, 1, 2] and all(v > 0 for v in values.values()), (key, values)
    assert history("time/weight_sync_s")[0] > 0 and history("time/weight_sync_s")[2] == 0  # no sync after the last
    checkpoint_s = history("time/checkpoint_s")
    assert checkpoint_s[1] > 0 and checkpoint_s[1] > 3 * max(checkpoint_s[0], checkpoint_s[2])  # only the second saves
    for step, wall in step_s.items():
        stages = sum(history(key)[step] for key in TRAINER_STAGES)
        assert stages <= wall * (1 + 1e-6), (step, stages, wall)
        assert stages >= 0.5 * wall, (step, stages, wall)  # the stages are where the time goes
    assert not history("throughput/mfu")  # CPU: no peak FLOP/s to compare with

    turns = [turn for trajectory in kept.trajectories for turn in trajectory.turns]
    assert turns and all(turn.timings["generation_s"] > 0 and turn.timings["env_s"] > 0 for turn in turns)
    solved = [t for t in kept.trajectories if t.reward == 1.0]
    assert solved and all(t.timings["scoring_s"] == t.turns[-1].timings["env_s"] > 0 for t in solved)
    # time/environment_s includes the scoring step (every turn's environment time), time/scoring_s is that step alone
    assert all(t.timings["tool_s"] == pytest.approx(sum(turn.timings["env_s"] for turn in t.turns)) for t in solved)


def test_stage_timings_are_logged_at_the_step_of_the_other_metrics_of_their_batch(tmp_path):
    """``time/*`` and ``throughput/*`` are logged at the step every other metric of the batch has (0 for the
    first), also when the optimizer step is timed by the module rather than by the optimizer."""
    from mlflow.tracking import MlflowClient

    from lightning_agentrl.envs.keydoor import parse_task, solve
    from tests.test_keydoor import MAP, moves
    from tests.test_learning_signal import maze_settings

    settings = maze_settings(tmp_path, "--trainer.max_steps=2", "--env.max_turns=10", "--tracking.enabled=true")
    result, _ = scripted_fit(settings, {"e0": moves(*solve(parse_task({"id": "m", "map": MAP}, "test")))})
    client = MlflowClient(tracking_uri=result.tracking_uri)

    def steps(key: str) -> list[int]:
        return sorted(m.step for m in client.get_metric_history(result.mlflow_run_id, key))

    assert steps("reward/mean") == steps("loss/total") == [0, 1]
    for key in ["time/step_s", "time/optimizer_s", "throughput/tokens_per_s"]:
        assert steps(key) == [0, 1], key
    optimizer_s = [m.value for m in client.get_metric_history(result.mlflow_run_id, "time/optimizer_s")]
    assert all(v > 0 for v in optimizer_s)


@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("deepspeed") is None, reason="needs deepspeed")
def test_under_zero2_the_optimizer_step_is_timed(tmp_path):
    """DeepSpeed steps its own optimizer (no torch step hooks): ``time/optimizer_s`` is measured around it."""
    import json
    import os
    import subprocess
    import sys

    from mlflow.tracking import MlflowClient

    from tests.fitting import REPO
    from tests.test_keydoor import MAP

    tasks = tmp_path / "maze.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"m{i}", "map": MAP}) + "\n" for i in range(2)))
    run = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "tests/fixtures/tiny_bugfix.yaml",
         "--env.kind=keydoor", f"--env.tasks={tasks}", "--env.split=all", f"--run.dir={run}",
         "--trainer.strategy=deepspeed_stage_2", "--trainer.accelerator=cpu", "--trainer.threads=1",
         "--trainer.max_steps=1", "--algorithm.entropy_coef=0.01", "--engine.max_new_tokens=16", "--env.max_turns=2",
         "--model.tiny_hidden_size=64", "--model.tiny_num_layers=1"],
        cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    run_id = (run / "mlflow_run_id.txt").read_text().strip()
    (optimizer_s,) = client.get_metric_history(run_id, "time/optimizer_s")
    assert optimizer_s.step == 0 and optimizer_s.value > 0
