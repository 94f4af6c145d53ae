"""Each callback changes the batch only through its documented fields, and resumes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from lightning_agentrl.callbacks import CompactFilter, GroupFilter, SegmentBoundaries, StalenessWeighting
from lightning_agentrl.trajectory import Segment, TerminationReason, Trajectory, Turn, pack


class Recorder:
    """The module's logging surface, at the test's edge."""

    def __init__(self) -> None:
        self.logged: dict[str, float] = {}

    def log_dict(self, metrics, **_):
        self.logged.update(metrics)

    def log(self, name, value, **_):
        self.logged[name] = value


def episode(i, *, reward, version, termination=TerminationReason.SUBMITTED, group=0, segments=1):
    trajectory = Trajectory(episode_id=f"e{i}", task_id="t", group_id=group, reward=reward, termination=termination)
    for _ in range(segments):
        segment = Segment()
        segment.extend([1, 2], mask=0)
        segment.extend([3, 4], mask=1, logprobs=[-1.0, -1.0], version=version)
        segment.turns.append(Turn(action_start=2, action_end=4))
        trajectory.segments.append(segment)
    trajectory.segments[-1].turns[-1].reward = reward
    return trajectory


def test_compact_filter_excludes_the_listed_reasons_and_counts_them():
    batch = pack([
        episode(0, reward=1, version=0),
        episode(1, reward=0, version=0, termination=TerminationReason.MAX_TURNS),
        episode(2, reward=0, version=0, termination=TerminationReason.SANDBOX_ERROR),
        episode(3, reward=0, version=0, termination=TerminationReason.TOOL_ERROR),
    ])
    module = Recorder()
    callback = CompactFilter(("sandbox_error", "max_turns", "max_context", "timeout"))
    callback.on_train_batch_start(SimpleNamespace(global_step=0), module, batch, 0)
    assert batch.include.tolist() == [True, False, False, True]
    assert module.logged["filter/excluded_max_turns"] == 1.0
    assert module.logged["filter/excluded_sandbox_error"] == 1.0
    restored = CompactFilter(("sandbox_error",))
    restored.load_state_dict(callback.state_dict())
    assert restored.state_dict() == callback.state_dict()


def test_staleness_weights_tokens_and_drops_episodes_past_the_bound():
    batch = pack([episode(i, reward=float(i % 2), version=v) for i, v in enumerate([5, 4, 3, 1])])
    module = Recorder()
    callback = StalenessWeighting("exp", rate=0.5, max_staleness=2)
    callback.on_train_batch_start(SimpleNamespace(global_step=5), module, batch, 0)
    assert batch.include.tolist() == [True, True, True, False]  # lag 4 > 2
    weights = batch.token_weights[batch.loss_mask > 0].reshape(4, 2)[:, 0]
    torch.testing.assert_close(weights, torch.exp(-0.5 * torch.tensor([0.0, 1.0, 2.0, 4.0])))
    assert batch.token_weights[batch.loss_mask == 0].eq(1).all()
    assert module.logged["staleness/tokens_lag_4"] == 2.0
    assert module.logged["staleness/num_dropped"] == 1.0
    assert callback.state_dict() == {"num_dropped": 1}


def test_group_filter_keeps_the_most_disagreeing_groups():
    rewards = [1, 1, 1, 1, 1, 0, 1, 0]  # group 0 agrees, group 1 disagrees
    batch = pack([episode(i, reward=r, version=0, group=i // 4) for i, r in enumerate(rewards)])
    GroupFilter(0.5).on_train_batch_start(SimpleNamespace(global_step=0), Recorder(), batch, 0)
    assert batch.include.tolist() == [False] * 4 + [True] * 4
    with pytest.raises(ValueError, match="keep_fraction"):
        GroupFilter(0.0)


def test_segment_boundaries_count_split_episodes_and_keep_the_outcome_on_the_last_turn():
    batch = pack([episode(0, reward=1, version=0, segments=3), episode(1, reward=0, version=0)])
    module = Recorder()
    SegmentBoundaries().on_train_batch_start(SimpleNamespace(global_step=0), module, batch, 0)
    assert module.logged["segments/split_episodes"] == 1.0
    assert module.logged["segments/per_episode"] == 2.0
    assert batch.turn_rewards.tolist() == [0.0, 0.0, 1.0, 0.0]
    assert batch.episode_ids.unique().tolist() == [0, 1]  # the three segments are one episode


def test_rollout_metrics_logs_a_credit_table_every_step_for_long_runs(tmp_path, tiny_tokenizer):
    """A credit table per step for 200 steps into a real MLflow sqlite store: none of them may break
    the run (MLflow's log_table keeps a per-run list in a tag that the store cuts at 8000 characters,
    which failed at step ~150 of a learning run)."""
    from lightning.pytorch.loggers import MLFlowLogger
    from mlflow.tracking import MlflowClient

    from lightning_agentrl.callbacks.trajectory_archive import TrajectoryArchive

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    logger = MLFlowLogger(experiment_name="credit", tracking_uri=uri, artifact_location=str(tmp_path / "artifacts"))
    callback = TrajectoryArchive(tmp_path / "run", tiny_tokenizer, num_samples=1)
    trajectories = [episode(i, reward=float(i % 2), version=0) for i in range(4)]
    for step in range(200):
        callback.save(SimpleNamespace(global_step=step, logger=logger), trajectories)
    client = MlflowClient(tracking_uri=uri)
    tables = [a.path for a in client.list_artifacts(logger.run_id, "credit")]
    assert len(tables) == 200
    local = client.download_artifacts(logger.run_id, "credit/step_000199.json", str(tmp_path / "down"))
    table = json.loads(open(local).read())
    assert len(table["data"]) == 4 and all(len(row) == len(table["columns"]) for row in table["data"])


def test_echo_trap_warning_reports_the_grad_norm_spike_that_follows_the_collapse(tmp_path, tiny_tokenizer):
    """The trainer's gradient norms reach the Echo Trap check: a collapse of within-group reward std
    followed by a grad-norm spike is reported with the spike, once."""
    import warnings

    from lightning_agentrl.callbacks.rollout_metrics import RolloutMetrics
    from lightning_agentrl.trajectory import pack

    callback = RolloutMetrics()
    batch = pack([episode(i, reward=float(i % 2), version=0) for i in range(4)])
    stds = [0.5] * 5 + [0.01] * 5
    norms = [1.0] * 5 + [1.0, 1.0, 1.0, 1.0, 9.0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for std, norm in zip(stds, norms, strict=True):
            callback._within_group_std.append(std)  # what on_train_batch_start records for the step
            trainer = SimpleNamespace(callback_metrics={"policy/grad_norm": torch.tensor(norm)})
            callback.on_train_batch_end(trainer, None, None, batch, 0)
    messages = [str(w.message) for w in caught if "Echo trap" in str(w.message)]
    assert len(messages) == 1
    assert "Grad norm spiked to 9" in messages[0]
    assert callback.state_dict()["grad_norms"] == norms
