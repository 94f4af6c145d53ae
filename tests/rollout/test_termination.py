"""Each termination reason of SPEC §4, forced on purpose against the real sandbox server.

The engine is scripted (it returns the ids of chosen tool calls) except where the engine itself is
what ends the episode: the context overflow by an over-long action uses the real TorchEngine.
"""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoModelForCausalLM

from lightning_agentrl.envs.coding import SYSTEM_PROMPT, CodingEnv
from lightning_agentrl.envs.tools import CODING_TOOLS
from lightning_agentrl.rollout.agent_loop import EpisodeBudget, check_token_in_token_out, run_episode
from lightning_agentrl.rollout.engine import SamplingParams, TorchEngine
from lightning_agentrl.trajectory import TerminationReason
from sandbox_client import SandboxClient
from tests.rollout.conftest import ScriptedEngine, call

SAMPLING = SamplingParams(max_new_tokens=512, temperature=1.0, seed=0)


def play(server, codec, task, engine, budget=EpisodeBudget(), *, tool_timeout_s=20.0, max_retries=4,
         on_env=None, sampling=SAMPLING):
    async def main():
        async with SandboxClient(server.url, server.token, max_retries=max_retries, backoff_s=0.01) as client:
            env = CodingEnv(client, task, tool_timeout_s=tool_timeout_s)
            if on_env is not None:
                on_env(env, client)
            trajectory = await run_episode(engine=engine, env=env, codec=codec, sampling=sampling, budget=budget,
                                           episode_id="ep", task_id=task.id, group_id=0)
            return trajectory, env
    trajectory, env = asyncio.run(main())
    assert trajectory.termination is not None
    assert env.sandbox_id is None, "a finished episode closes its environment"
    check_token_in_token_out([trajectory])
    return trajectory


def prompt_length(codec, task) -> int:
    tools = "\n".join(tool.render() for tool in CODING_TOOLS)
    messages = [{"role": "system", "content": SYSTEM_PROMPT.format(tools=tools)}, {"role": "user", "content": task.prompt}]
    return len(codec.prompt_ids(messages))


def test_submitting_the_reference_fix_ends_submitted_with_reward_1(sandbox_server, codec, task):
    fix = task.solution_files["search.py"]
    engine = ScriptedEngine(codec, {"*": [call("write_file", path="search.py", content=fix), call("submit")]})
    trajectory = play(sandbox_server, codec, task, engine)
    assert trajectory.termination is TerminationReason.SUBMITTED
    assert trajectory.reward == 1.0
    assert [turn.tool for turn in trajectory.turns] == ["write_file", "submit"]


def test_submitting_the_bug_ends_submitted_with_reward_0(sandbox_server, codec, task):
    trajectory = play(sandbox_server, codec, task, ScriptedEngine(codec, {"*": [call("submit")]}))
    assert trajectory.termination is TerminationReason.SUBMITTED
    assert trajectory.reward == 0.0


def test_max_turns(sandbox_server, codec, task):
    engine = ScriptedEngine(codec, {"*": [call("read_file", path="search.py")]})
    trajectory = play(sandbox_server, codec, task, engine, EpisodeBudget(max_turns=3))
    assert trajectory.termination is TerminationReason.MAX_TURNS
    assert len(trajectory.turns) == 3 and trajectory.reward == 0.0


def test_max_context_when_an_observation_does_not_fit(sandbox_server, codec, task):
    budget = EpisodeBudget(max_context_tokens=prompt_length(codec, task) + 60)
    engine = ScriptedEngine(codec, {"*": [call("read_file", path="search.py")]})
    trajectory = play(sandbox_server, codec, task, engine, budget)
    assert trajectory.termination is TerminationReason.MAX_CONTEXT
    assert len(trajectory.turns) == 1
    assert len(trajectory.segments[0].token_ids) <= budget.max_context_tokens


def test_max_context_when_the_real_engine_fills_the_context(sandbox_server, codec, task, tiny_model_path):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    engine = TorchEngine(model, pad_token_id=codec.eos_token_id)
    budget = EpisodeBudget(max_context_tokens=prompt_length(codec, task) + 24)
    trajectory = play(sandbox_server, codec, task, engine, budget, sampling=SamplingParams(max_new_tokens=64, seed=3))
    assert trajectory.termination is TerminationReason.MAX_CONTEXT
    segment = trajectory.segments[0]
    assert len(segment.token_ids) == budget.max_context_tokens  # the action was cut at the limit
    assert segment.turns[0].action_end - segment.turns[0].action_start == 24


def test_generation_timeout(sandbox_server, codec, task):
    engine = ScriptedEngine(codec, {"*": [call("submit")]}, delay_s=1.0)
    trajectory = play(sandbox_server, codec, task, engine, EpisodeBudget(generation_timeout_s=0.1))
    assert trajectory.termination is TerminationReason.TIMEOUT
    assert trajectory.info["timeout"] == "generation"
    assert trajectory.turns == [] and trajectory.reward == 0.0


def test_tool_timeout_kills_a_hanging_command(sandbox_server, codec, task):
    engine = ScriptedEngine(codec, {"*": [call("run", command="sleep 30")]})
    trajectory = play(sandbox_server, codec, task, engine, tool_timeout_s=0.5)
    assert trajectory.termination is TerminationReason.TIMEOUT
    assert trajectory.info["timeout"] == "tool"
    assert trajectory.timings["tool_s"] < 10


def test_episode_wall_clock_budget(sandbox_server, codec, task):
    engine = ScriptedEngine(codec, {"*": [call("read_file", path="search.py")]}, delay_s=0.3)
    budget = EpisodeBudget(max_turns=50, generation_timeout_s=10.0, episode_timeout_s=1.5)
    trajectory = play(sandbox_server, codec, task, engine, budget)
    assert trajectory.termination is TerminationReason.TIMEOUT
    assert trajectory.info["timeout"] == "episode"
    # Each turn takes at least the engine's 0.3 s, so the 1.5 s budget allows at most 5 whole turns
    # (and a slow machine may finish fewer; the 50-turn cap is never reached).
    assert len(trajectory.turns) <= 5


def test_consecutive_malformed_calls_end_with_tool_error(sandbox_server, codec, task):
    engine = ScriptedEngine(codec, {"*": ["no tool call here"]})
    trajectory = play(sandbox_server, codec, task, engine, EpisodeBudget(max_turns=10, max_tool_errors=3))
    assert trajectory.termination is TerminationReason.TOOL_ERROR
    assert len(trajectory.turns) == 3


def test_a_valid_call_resets_the_tool_error_count(sandbox_server, codec, task):
    script = ["bad", "bad", call("read_file", path="search.py"), "bad", "bad", call("submit")]
    engine = ScriptedEngine(codec, {"*": script})
    trajectory = play(sandbox_server, codec, task, engine, EpisodeBudget(max_turns=10, max_tool_errors=3))
    assert trajectory.termination is TerminationReason.SUBMITTED


def test_sandbox_deleted_underneath_ends_with_sandbox_error(sandbox_server, codec, task):
    held = {}

    async def delete_sandbox(session_id, index):
        if index == 1:
            await held["client"].delete(held["env"].sandbox_id)

    engine = ScriptedEngine(codec, {"*": [call("read_file", path="search.py")]}, before_request=delete_sandbox)
    trajectory = play(sandbox_server, codec, task, engine, EpisodeBudget(max_turns=5),
                      on_env=lambda env, client: held.update(env=env, client=client))
    assert trajectory.termination is TerminationReason.SANDBOX_ERROR
    assert "SandboxNotFound" in trajectory.info["sandbox_error"]
    assert len(trajectory.turns) == 2 and trajectory.reward == 0.0


def test_server_killed_mid_episode_ends_with_sandbox_error(codec, task):
    from sandbox_server.launch import start_local_server

    with start_local_server() as server:
        async def kill_server(session_id, index):
            if index == 1:
                await asyncio.to_thread(server.stop)

        engine = ScriptedEngine(codec, {"*": [call("read_file", path="search.py")]}, before_request=kill_server)
        trajectory = play(server, codec, task, engine, EpisodeBudget(max_turns=5), max_retries=1)
    assert trajectory.termination is TerminationReason.SANDBOX_ERROR
    assert "unreachable" in trajectory.info["sandbox_error"]


@pytest.mark.parametrize("field", ["max_turns", "max_context_tokens", "max_tool_errors"])
def test_budget_rejects_non_positive_limits(field):
    with pytest.raises(ValueError, match=field):
        EpisodeBudget(**{field: 0})


def test_a_submission_whose_tests_run_past_the_scoring_limit_ends_as_scoring_timeout(sandbox_server, codec, task):
    hang = "def find_first(items, target):\n    while True:\n        pass\n\n\ndef contains(items, target):\n" \
           "    return find_first(items, target) != -1\n"
    engine = ScriptedEngine(codec, {"*": [call("write_file", path="search.py", content=hang), call("submit")]})
    trajectory = play(sandbox_server, codec, task, engine,
                      on_env=lambda env, client: setattr(env, "scoring_timeout_s", 1.0))
    assert trajectory.termination is TerminationReason.SCORING_TIMEOUT
    assert trajectory.reward == 0.0 and not trajectory.termination.truncated


def test_the_budget_is_the_env_settings_with_their_defaults():
    from lightning_agentrl.settings import EnvSettings, load_settings

    env = load_settings(None, ["--env.max_turns=7", "--env.max_tool_errors=2"]).env
    assert EpisodeBudget.from_settings(env) == EpisodeBudget(max_turns=7, max_tool_errors=2)
    defaults = EnvSettings.model_fields
    assert all(getattr(EpisodeBudget(), name) == defaults[name].default for name in EpisodeBudget.__dataclass_fields__)


def test_a_submitted_workspace_too_slow_to_snapshot_ends_unscorable_with_reward_0_not_sandbox_error(
        codec, task, tmp_path):
    """The agent builds a tree the server cannot copy within fork_timeout_s, then submits: the episode is the
    agent's doing (reward 0, unscorable_workspace), never sandbox_error (excluded, counted by the breaker)."""
    from sandbox_server.launch import start_local_server

    make_tree = "python -c \"import os\nfor i in range(300):\n    os.makedirs(f'w/{i}/' + '/'.join('abcdefgh'))\""
    engine = ScriptedEngine(codec, {"*": [call("run", command=make_tree), call("submit")]})
    with start_local_server(fork_timeout_s=0.02, root_dir=str(tmp_path / "boxes")) as server:
        trajectory = play(server, codec, task, engine)
    assert trajectory.termination is TerminationReason.UNSCORABLE_WORKSPACE
    assert trajectory.reward == 0.0
    assert not trajectory.termination.infrastructure and not trajectory.termination.truncated
