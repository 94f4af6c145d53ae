"""A user's environment at fault, through ``fit``: its own errors stop the run naming its class and
method (with the traceback logged), never hang it; what it returns is made safe for the tokenizer and
clipped to ``env.max_observation_chars``; what it declares is checked at settings time."""

from __future__ import annotations

import json
import logging

import pytest

from lightning_agentrl.settings import SettingsError, load_settings
from tests import envs_thirdparty as thirdparty
from tests.fitting import learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(120)
COUNT_DOWN = {"*": ["2", "1", "0"]}  # every episode solves its task (start 3)


def countdown(tmp_path, env: str, *overrides: str):
    tasks = tmp_path / "countdown.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"c{i}", "start": 3}) + "\n" for i in range(2)))
    return learn_settings(tmp_path, f"--env.kind=tests.envs_thirdparty:{env}", f"--env.tasks={tasks}",
                          "--env.max_turns=3", "--trainer.max_steps=1", *overrides)


def decoded(settings, trajectory) -> str:
    from transformers import AutoTokenizer

    from lightning_agentrl.train import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings))
    return "".join(tokenizer.decode(segment.token_ids) for segment in trajectory.segments)


@pytest.mark.parametrize(("env", "message"), [
    # was a hang: the group's task ended cancelled, the service skipped it, the trainer waited forever
    ("CancellingCountdownEnv", "CancellingCountdownEnv.step raised CancelledError: inner request cancelled"),
    # was "KeyError: 'missing'": no class, no method, no traceback anywhere
    ("BuggyCountdownEnv", "BuggyCountdownEnv.step raised KeyError: 'missing'"),
])
def test_an_environment_s_own_error_stops_the_run_naming_its_class_and_method(tmp_path, caplog, env, message):
    settings = countdown(tmp_path, env, "--env.episode_timeout_s=60")
    with caplog.at_level(logging.ERROR, "lightning_agentrl.rollout.agent_loop"), pytest.raises(Exception) as err:
        scripted_fit(settings, COUNT_DOWN)
    assert message in str(err.value)
    logged = [record for record in caplog.records if message in record.getMessage()]
    assert logged and all(record.exc_info is not None for record in logged)
    assert "envs_thirdparty.py" in caplog.text and "in step" in caplog.text  # the traceback, down to the user's line


def test_every_observation_is_clipped_to_max_observation_chars_once(tmp_path):
    """Each observation is 20 000 characters; clipped to 200 the episodes end by solving their task (before:
    unclipped, the first observation ran past the context, ``max_context``)."""
    settings = countdown(tmp_path, "HugeCountdownEnv", "--env.max_observation_chars=200")
    result, log = scripted_fit(settings, COUNT_DOWN)
    (batch,) = log.batches
    assert [t.termination.value for t in batch.trajectories] == ["submitted"] * 4
    text = decoded(settings, batch.trajectories[0])
    cut = f"[... {len('yes, now 2') + 1 + thirdparty.HUGE - 200} more characters cut]"
    assert text.count(cut) == 2 and text.count("more characters cut") == 2  # two observations, each cut once
    assert text.count("x" * 150) == 2 and "x" * 300 not in text


def test_text_utf8_cannot_encode_is_replaced_not_fatal(tmp_path):
    """Lone surrogates in the opening messages and the observations (before: the tokenizer's TypeError
    killed the run, naming no environment)."""
    settings = countdown(tmp_path, "SurrogateCountdownEnv")
    result, log = scripted_fit(settings, COUNT_DOWN)
    assert result.global_step == 1
    text = decoded(settings, log.batches[0].trajectories[0])
    assert "Reply with the next number only. ?" in text and "Start: 3 ?" in text
    assert "yes, now 2 ? end" in text and "yes, now 1 ? end" in text


@pytest.mark.parametrize(("env", "message"), [
    ("MethodSimilarityCountdownEnv", "state_similarity must be a function of two state texts, e.g. a @staticmethod"),
    ("DistanceCountdownEnv", "state_similarity('a', 'a') returned 5.0; it must be a similarity in [0, 1]"),
])
def test_a_state_similarity_gigpo_cannot_use_is_refused_at_settings_time(env, message):
    """Before: a plain method failed at the first training step after a whole rollout round; a distance
    merged every state into one anchor group without a word."""
    with pytest.raises(SettingsError, match="invalid settings") as err:
        load_settings(None, [f"--env.kind=tests.envs_thirdparty:{env}"])
    assert f"env.kind: tests.envs_thirdparty:{env}: {message}" in str(err.value)


@pytest.mark.parametrize(("source", "message"), [
    ("class Env(:\n", "SyntaxError: "),
    ("raise RuntimeError('no backend configured')\n", "RuntimeError: no backend configured"),
])
def test_a_module_that_fails_to_import_is_an_env_kind_error(tmp_path, monkeypatch, source, message):
    (tmp_path / "broken_user_envs.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SettingsError, match="invalid settings") as err:
        load_settings(None, ["--env.kind=broken_user_envs:Env"])
    assert f"env.kind: cannot import 'broken_user_envs' (from 'broken_user_envs:Env'): {message}" in str(err.value)


def test_parking_an_environment_without_state_dict_warns_once_naming_what_is_lost(caplog):
    from lightning_agentrl.rollout.agent_loop import save_env_state

    envs = [thirdparty.SetStateCountdownEnv(thirdparty.CountdownTask(f"c{i}", start=3)) for i in range(2)]
    with caplog.at_level(logging.WARNING, "lightning_agentrl.rollout.agent_loop"):
        states = [save_env_state(env) for env in envs]
    assert states[0] == {"current": 3, "where": (3, 0)}
    (record,) = [r for r in caplog.records if "has no state_dict" in r.getMessage()]  # once per class
    message = record.getMessage()
    assert message.startswith("SetStateCountdownEnv has no state_dict: a parked episode restored from a checkpoint "
                              "loses task (CountdownTask, dropped), said (set, dropped), where (tuple, comes back as "
                              "list)")


def test_an_outage_of_an_environment_s_own_backend_is_not_called_the_sandbox_service_s(tmp_path):
    from lightning_agentrl.callbacks.circuit_breaker import SandboxOutage

    settings = countdown(tmp_path, "DownCountdownEnv")
    with pytest.raises(SandboxOutage) as err:
        scripted_fit(settings, COUNT_DOWN)
    assert str(err.value).startswith("the environment's infrastructure failed: every episode of the step (4) ended "
                                     "with sandbox_error; last error: EnvInfraError: search backend unreachable.")
    assert "sandbox service" not in str(err.value)


def test_a_step_that_blocks_the_event_loop_stops_the_run_naming_it(tmp_path, caplog):
    """``time.sleep`` inside ``async def step`` blocks every episode and the episode timeout (2 s) cannot
    fire: the watchdog names the method once the loop has not run for that long (before: a silent hang
    until the step returned, forever for a blocking call that never does)."""
    import time

    settings = countdown(tmp_path, "BlockingCountdownEnv", "--env.episode_timeout_s=2")
    thirdparty.BlockingCountdownEnv.blocked = False
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, "lightning_agentrl.rollout.service"), pytest.raises(Exception) as err:
        scripted_fit(settings, COUNT_DOWN)
    assert "BlockingCountdownEnv.step (" in str(err.value) and "envs_thirdparty.py:" in str(err.value)
    assert "has blocked the rollout's event loop for" in str(err.value) and "asyncio.to_thread" in str(err.value)
    assert "time.sleep(BLOCK_S)" in caplog.text  # the blocked thread's stack is logged
    assert time.monotonic() - started < 5 * thirdparty.BLOCK_S
