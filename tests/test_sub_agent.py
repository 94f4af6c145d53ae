"""Multi-agent (SPEC §2): an environment's tool calls a frozen sub-agent (``env.sub_agent``, a second model
served by the torch engine); its answers enter the trajectory as observations (mask 0) and its weights
never change while the policy's do."""

from __future__ import annotations

import json

import pytest
import torch

from lightning_agentrl.settings import SettingsError, load_settings
from tests.envs_thirdparty import AskEnv
from tests.fitting import learn_settings, scripted_fit

pytestmark = pytest.mark.timeout(300)


def _contains(ids: list[int], part: list[int]) -> int | None:
    """Where ``part`` starts in ``ids``, or None."""
    return next((i for i in range(len(ids) - len(part) + 1) if ids[i:i + len(part)] == part), None)


def test_a_sub_agent_answers_as_an_observation_and_stays_frozen(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tasks = tmp_path / "countdown.jsonl"
    tasks.write_text("".join(json.dumps({"id": f"c{i}", "start": 3}) + "\n" for i in range(2)))
    settings = learn_settings(tmp_path, "--env.kind=tests.envs_thirdparty:AskEnv", f"--env.tasks={tasks}",
                              "--env.sub_agent.model_path=tiny", "--env.sub_agent.max_new_tokens=8",
                              "--env.sub_agent.temperature=1.0", "--env.max_turns=4", "--trainer.max_steps=1")
    AskEnv.answers.clear()
    result, log = scripted_fit(settings, {"e0": ["ask: what comes after 3?", "2", "1", "0"], "e1": ["5"]})
    (batch,) = log.batches
    asked = [t for t in batch.trajectories if t.episode_id.endswith("e0")]
    assert [t.reward for t in asked] == [1.0, 1.0]  # asking, then counting down: the policy gets a signal
    assert len(AskEnv.answers) == len(asked) == 2
    sub_agent = AskEnv.answers[0][1]
    tokenizer = AutoTokenizer.from_pretrained(sub_agent.engine.model.name_or_path)
    for trajectory in asked:
        segment = trajectory.segments[0]
        observations = [tokenizer.encode(f"sub-agent: {answer}", add_special_tokens=False) for answer, _ in AskEnv.answers]
        # one of the answers is in this episode's context, as an observation: not trained on
        start, ids = next((_contains(segment.token_ids, ids), ids) for ids in observations
                          if _contains(segment.token_ids, ids) is not None)
        assert set(segment.loss_mask[start:start + len(ids)]) == {0}
        assert trajectory.turns[0].tool == "ask"
    # the sub-agent is frozen: its weights are those on disk; the policy's moved
    frozen = AutoModelForCausalLM.from_pretrained(sub_agent.engine.model.name_or_path).state_dict()
    for name, tensor in sub_agent.engine.model.state_dict().items():
        assert torch.equal(tensor, frozen[name]), name
    trained = {}
    for file in result.policy_dir.glob("*.safetensors"):
        trained.update(load_file(str(file)))
    assert any(not torch.equal(trained[name], frozen[name]) for name in trained if name in frozen)


def test_a_sub_agent_needs_the_torch_engine():
    with pytest.raises(SettingsError, match="env.sub_agent: the sub-agent is served by the torch engine"):
        load_settings(None, ["--env.sub_agent.model_path=tiny", "--engine.kind=vllm"])


def test_a_missing_sub_agent_model_is_refused_at_preflight_naming_the_setting(tmp_path):
    from lightning_agentrl.preflight import PreflightError, check_sub_agent_path, preflight
    from tests.fitting import REPO, TINY

    settings = load_settings(None, ["--env.kind=keydoor", f"--env.tasks={REPO / 'tasks' / 'keydoor'}", "--model.path=tiny",
                                    f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}",
                                    f"--env.sub_agent.model_path={tmp_path / 'nowhere'}", *TINY])
    with pytest.raises(PreflightError, match=f"env.sub_agent.model_path: no such folder: {tmp_path / 'nowhere'}"):
        preflight(settings, network=False)
    (tmp_path / "empty").mkdir()
    with pytest.raises(PreflightError, match="env.sub_agent.model_path: .*empty has no config.json"):
        check_sub_agent_path(str(tmp_path / "empty"), network=False)
    check_sub_agent_path("tiny", network=False)


def test_a_sub_agent_s_answers_depend_on_the_episode_and_the_call_not_on_earlier_calls(tiny_tokenizer):
    """Sampled at temperature 1, call k of episode g0-e0 gets the seed of (run seed, g0-e0, k): the same
    answers from a fresh sub-agent and from one another episode asked first (before: the seed was the run
    seed plus the process's count of calls, so the answers changed with the episodes' interleaving, per
    rank and after a resume)."""
    import asyncio

    from lightning_agentrl.rollout.agent_loop import EpisodeBudget, run_episode
    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.rollout.engine import SamplingParams
    from lightning_agentrl.rollout.sub_agent import build_sub_agent
    from tests.envs_thirdparty import CountdownTask
    from tests.fitting import REPO, TINY
    from tests.rollout.conftest import ScriptedEngine

    settings = load_settings(None, ["--env.sub_agent.model_path=tiny", "--env.sub_agent.temperature=1.0",
                                    "--env.sub_agent.max_new_tokens=12", "--engine.kind=torch", *TINY,
                                    f"--model.cache_dir={REPO / '.cache' / 'lightning_agentrl'}"])
    codec = ChatCodec(tiny_tokenizer)

    async def answers(agent, episode_id: str) -> list[str]:
        env = AskEnv(CountdownTask("c", start=3))
        env.sub_agent = agent
        AskEnv.answers.clear()
        engine = ScriptedEngine(codec, {"*": ["ask: what comes after 3?", "ask: and after 2?"]})
        await run_episode(engine=engine, env=env, codec=codec, sampling=SamplingParams(max_new_tokens=8),
                          budget=EpisodeBudget(max_turns=2), episode_id=episode_id, task_id="c", group_id=0)
        return [answer for answer, _ in AskEnv.answers]

    async def fresh_and_busy():  # one event loop: the sub-agent's engine lives in it
        fresh = await answers(build_sub_agent(settings), "g0-e0")
        busy = build_sub_agent(settings)
        return fresh, await answers(busy, "g1-e0"), await answers(busy, "g0-e0")

    fresh, other, again = asyncio.run(fresh_and_busy())
    assert again == fresh and len(fresh) == 2
    assert other != fresh  # another episode, other seeds
