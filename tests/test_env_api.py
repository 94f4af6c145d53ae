"""The environment API from a user's side: ``env.kind`` by dotted path, checked at settings time, and
a third-party environment (:mod:`tests.envs_thirdparty`) trained through ``fit`` unchanged."""

from __future__ import annotations

import asyncio
import json
import re

import pytest
import torch

from lightning_agentrl.settings import SettingsError, load_settings
from tests import envs_thirdparty as thirdparty
from tests.envs_thirdparty import STEP_REWARD
from tests.fitting import learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize(("kind", "message"), [
    ("nosuch.module:Env", "env.kind: cannot import 'nosuch.module'"),
    ("tests.envs_thirdparty:NoSuchEnv", "env.kind: module 'tests.envs_thirdparty' has no 'NoSuchEnv'"),
    ("tests.envs_thirdparty:CountdownTask", "env.kind: tests.envs_thirdparty:CountdownTask is not a subclass of"),
    ("lightning_agentrl.envs.base:Environment", "does not implement reset, state_text, step"),
    ("chess", "env.kind: 'chess' is neither a shipped environment (coding, keydoor, gateway) nor a dotted path"),
])
def test_a_bad_env_kind_is_refused_at_settings_time_naming_the_setting(kind, message):
    with pytest.raises(SettingsError, match="invalid settings") as err:
        load_settings(None, [f"--env.kind={kind}"])
    assert message in str(err.value)


def test_shipped_and_dotted_kinds_are_accepted():
    assert load_settings(None, []).env.kind == "coding"
    assert load_settings(None, ["--env.kind=tests.envs_thirdparty:CountdownEnv"]).env.kind.endswith("CountdownEnv")


def test_a_third_party_environment_trains_through_fit(tmp_path):
    """Episode 0 of every group counts 2, 1, 0 (rewards 0.1 then 1); the tiny model's episodes say
    nothing right (error observations, reward 0)."""
    tasks = tmp_path / "countdown.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"c{i}", "start": 2}) + "\n" for i in range(2)))
    settings = learn_settings(tmp_path, "--env.kind=tests.envs_thirdparty:CountdownEnv", f"--env.tasks={tasks}")
    result, log = scripted_fit(settings, {"e0": ["1", "0"]})
    assert result.global_step == 2
    for batch, step in zip(log.batches, log.metrics, strict=True):
        solved = [t for t in batch.trajectories if t.episode_id.endswith("e0")]
        assert len(solved) == 2 and all(t.reward == 1.0 and len(t.turns) == 2 for t in solved)
        assert [turn.reward for turn in solved[0].turns] == [STEP_REWARD, 1.0]
        assert {t.task_id for t in batch.trajectories} == {"c0", "c1"}
        per_turn = [turn.reward for t in batch.trajectories for turn in t.turns]
        assert batch.turn_rewards.tolist() == pytest.approx(per_turn)  # the packed batch carries the env's rewards
        assert per_turn.count(1.0) == 2 and per_turn.count(STEP_REWARD) >= 2, per_turn
        assert step["reward/mean"] == pytest.approx(0.5)  # 2 of 4 episodes solved
        assert torch.equal(batch.rewards.sort().values, torch.tensor([0.0, 0.0, 1.0, 1.0]))


@pytest.mark.parametrize(("failure", "termination", "info"), [
    ("BackendDown", "sandbox_error", {"sandbox_error": "BackendDown: backend failed at 1"}),
    ("BackendSlow", "timeout", {"timeout": "tool"}),
])
def test_a_third_party_backend_error_is_classified_by_the_environment(tiny_tokenizer, failure, termination, info):
    """Its own exception types reach the loop as EnvInfraError (excluded, not scored) or ToolTimeout."""
    trajectory, env = play_flaky(tiny_tokenizer, getattr(thirdparty, failure))
    assert trajectory.termination.value == termination and trajectory.reward == 0.0
    assert {k: trajectory.info[k] for k in info} == info
    assert [turn.reward for turn in trajectory.turns] == [STEP_REWARD, 0.0]  # the first step counted down
    assert env.current == 2


def test_an_unclassified_error_fails_loudly_naming_the_class_and_method(tiny_tokenizer):
    from lightning_agentrl.envs.base import EnvError

    with pytest.raises(EnvError, match="^FlakyCountdownEnv.step raised ZeroDivisionError: backend failed at 1$") as err:
        play_flaky(tiny_tokenizer, ZeroDivisionError)
    assert isinstance(err.value.__cause__, ZeroDivisionError)


def test_a_sync_step_is_refused_at_settings_time():
    with pytest.raises(SettingsError, match="invalid settings") as err:
        load_settings(None, ["--env.kind=tests.envs_thirdparty:SyncStepEnv"])
    assert "tests.envs_thirdparty:SyncStepEnv: step must be `async def`" in str(err.value)


@pytest.mark.parametrize(("env_class", "message"), [
    ("NanCountdownEnv", "NanCountdownEnv.step returned reward nan; it must be a finite number"),
    ("TupleStepEnv", "TupleStepEnv.step must return a StepResult, got tuple"),
    # was AttributeError: 'int' object has no attribute 'encode' (state_key hashed it before the check)
    ("IntStateCountdownEnv", "IntStateCountdownEnv.state_text must be a str, got int 3"),
    ("ToolDictEnv", r"ToolDictEnv.step returned info\['tool'\] dict \{'name': 'say'\}; it must be the tool's name"),
])
def test_what_an_environment_returns_is_checked_naming_its_class_and_method(tiny_tokenizer, env_class, message):
    """A NaN reward would train every weight to NaN; a gym tuple would fail far from its cause."""
    from lightning_agentrl.envs.base import EnvContractError

    with pytest.raises(EnvContractError, match=message):
        play(tiny_tokenizer, getattr(thirdparty, env_class)(thirdparty.CountdownTask("c", start=3)))


def test_a_failing_close_does_not_end_the_run_or_change_the_episode(tiny_tokenizer):
    trajectory = play(tiny_tokenizer, thirdparty.FailingCloseEnv(thirdparty.CountdownTask("c", start=3)))
    assert trajectory.termination.value == "submitted" and trajectory.reward == 1.0


@pytest.mark.parametrize(("lines", "message"), [
    ([{"id": "c0", "start": 2}, {"id": "c0", "start": 3}], "two tasks share the id 'c0'"),
    ([{"id": "", "start": 2}], "task 0 (CountdownTask) has no `id`"),
])
def test_tasks_without_an_id_or_with_a_shared_one_are_refused_at_start(tmp_path, lines, message):
    from lightning_agentrl.preflight import PreflightError, check_tasks

    tasks = tmp_path / "countdown.jsonl"
    tasks.write_text("".join(json.dumps(line) + "\n" for line in lines))
    settings = load_settings(None, ["--env.kind=tests.envs_thirdparty:CountdownEnv", f"--env.tasks={tasks}"])
    with pytest.raises(PreflightError, match=f"^env.tasks: .*{re.escape(message)}"):
        check_tasks(settings)


def play(tokenizer, env):
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget, run_episode
    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.rollout.engine import SamplingParams
    from tests.rollout.conftest import ScriptedEngine

    codec = ChatCodec(tokenizer)
    engine = ScriptedEngine(codec, {"*": ["2", "1", "0"]})
    return asyncio.run(run_episode(
        engine=engine, env=env, codec=codec, sampling=SamplingParams(max_new_tokens=8), budget=EpisodeBudget(),
        episode_id="g0-e0", task_id="c", group_id=0,
    ))


def play_flaky(tokenizer, failure):
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget, run_episode
    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.rollout.engine import SamplingParams
    from tests.rollout.conftest import ScriptedEngine

    codec = ChatCodec(tokenizer)
    env = thirdparty.FlakyCountdownEnv(thirdparty.CountdownTask("c", start=3))
    env.failure = failure
    engine = ScriptedEngine(codec, {"*": ["2", "1", "0"]})
    trajectory = asyncio.run(run_episode(
        engine=engine, env=env, codec=codec, sampling=SamplingParams(max_new_tokens=8), budget=EpisodeBudget(),
        episode_id="g0-e0", task_id="c", group_id=0,
    ))
    return trajectory, env


def test_an_environment_s_own_similarity_groups_gigpo_anchor_states(tmp_path):
    """Per group, episode 0 counts 3, 2, 1 (states "at 3", "at 2", "at 1") and episode 1 repeats a wrong
    number three times ("at 3" x3). The text similarity makes 3 anchor groups per group; the environment's
    parity similarity 2 ("at 3" and "at 1" are alike): 4 in all, the largest of 5 turns."""
    from lightning_agentrl.algorithms import advantages as adv

    tasks = tmp_path / "countdown.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"c{i}", "start": 3}) + "\n" for i in range(2)))
    settings = learn_settings(tmp_path, "--env.kind=tests.envs_thirdparty:ParityCountdownEnv", f"--env.tasks={tasks}",
                              "--env.max_turns=3", "--algorithm.advantage=gigpo", "--algorithm.gigpo_similarity=0.99",
                              "--trainer.max_steps=1")
    _, log = scripted_fit(settings, {"e0": ["2", "1", "0"], "e1": ["5"]})
    (batch,), (step,) = log.batches, log.metrics
    assert step["gigpo/num_anchor_groups"] == 4.0
    assert step["gigpo/max_anchor_group_size"] == 5.0
    by_text = adv.anchor_group_ids(batch.anchor_states(0.99), batch.group_ids[batch.turn_episode], 0.99)
    assert int(by_text.max()) + 1 == 6  # the default similarity on the same turns
