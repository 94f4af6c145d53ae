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
