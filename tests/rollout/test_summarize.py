"""Summarized history: an overflowing context opens a new segment of the same episode (SPEC §4)."""

from __future__ import annotations

import asyncio

import pytest

from lightning_agentrl.rollout.agent_loop import EpisodeBudget, check_token_in_token_out, run_episode
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.rollout.summarize import SUMMARY_HEADER, make_summarizer
from lightning_agentrl.trajectory import TerminationReason, pack
from tests.rollout.conftest import CountingEnv, ScriptedEngine, call

ACTION = call("run", command="python -m pytest -q")
SUMMARY = "The bug is in utils.py; nothing written yet."
SAMPLING = SamplingParams(max_new_tokens=40, seed=0)


def play(codec, kind: str, max_context_tokens: int = 400):
    summarizer = make_summarizer(kind, codec, max_summary_tokens=24)
    engine = ScriptedEngine(codec, {"*": [ACTION]})
    if kind == "policy":  # the summary request is the one that follows the instruction
        instruction = summarizer.instruction_ids()
        real_generate = engine.generate

        async def generate(prompt_ids, sampling, session_id):
            if prompt_ids[-len(instruction):] == instruction:
                engine.script["summary"] = [SUMMARY]
                return await real_generate(prompt_ids, sampling, "summary")
            return await real_generate(prompt_ids, sampling, session_id)

        engine.generate = generate
    env = CountingEnv(observation_chars=120)
    budget = EpisodeBudget(max_turns=8, max_context_tokens=max_context_tokens)
    trajectory = asyncio.run(run_episode(engine=engine, env=env, codec=codec, sampling=SAMPLING, budget=budget,
                                         episode_id="ep", task_id="t", group_id=3, summarizer=summarizer))
    return trajectory, env, summarizer


@pytest.mark.parametrize("kind", ["rule", "policy"])
def test_summaries_split_an_episode_into_segments_that_fit(codec, kind):
    trajectory, env, _ = play(codec, kind)
    assert trajectory.termination is TerminationReason.MAX_TURNS  # the context never ended the episode
    assert len(trajectory.segments) >= 2
    assert env.num_steps == 8
    assert all(len(s.token_ids) <= 400 for s in trajectory.segments)
    opening = asyncio.run(CountingEnv().reset())
    for segment in trajectory.segments[1:]:
        # each new segment opens with the opening messages + one summary message, all observation
        text = codec.decode(segment.token_ids)
        assert text.count(SUMMARY_HEADER) == 1 and opening[1]["content"] in text
        prefix = segment.turns[0].action_start
        assert segment.loss_mask[:prefix] == [0] * prefix
        system_and_task = codec.tokenizer.apply_chat_template(opening, tokenize=False)
        assert text.startswith(codec.decode(codec.encode(system_and_task)))  # the opening messages, verbatim
    assert check_token_in_token_out([trajectory]) == len(trajectory.turns)


def test_rule_summary_is_an_observation_and_keeps_the_last_output(codec):
    trajectory, _, _ = play(codec, "rule")
    assert all(turn.tool == "run" for turn in trajectory.turns)  # no summary action
    first, second = trajectory.segments[0], trajectory.segments[1]
    last_observation = f"step {len(first.turns)}: "
    assert last_observation in codec.decode(second.token_ids[: second.turns[0].action_start])
    assert "Tools used: run x" in codec.decode(second.token_ids)
    assert sum(second.loss_mask) == sum(t.action_end - t.action_start for t in second.turns)


def test_policy_summary_is_an_action_in_the_segment_it_was_sampled_in(codec):
    trajectory, _, summarizer = play(codec, "policy")
    first, second = trajectory.segments[0], trajectory.segments[1]
    summary_turn = first.turns[-1]
    assert summary_turn.tool == "summarize"
    span = range(summary_turn.action_start, summary_turn.action_end)
    assert [first.loss_mask[t] for t in span] == [1] * len(span)
    assert all(first.behavior_logprobs[t] is not None and first.policy_versions[t] == 0 for t in span)
    instruction = summarizer.instruction_ids()
    assert first.token_ids[summary_turn.action_start - len(instruction) : summary_turn.action_start] == instruction
    assert summary_turn.action_end == len(first.token_ids)  # the segment ends with the summary
    assert len(first.token_ids) <= 400  # the reserve kept room for instruction + summary
    assert SUMMARY in codec.decode(second.token_ids)  # the new segment sees it as context, mask 0
    assert second.turns[0].tool == "run"


@pytest.mark.parametrize("kind", ["rule", "policy"])
def test_pack_restarts_positions_per_segment_and_keeps_one_episode(codec, kind):
    trajectory, _, _ = play(codec, kind)
    batch = pack([trajectory])
    lengths = [len(s.token_ids) for s in trajectory.segments]
    expected_positions = [p for n in lengths for p in range(n)]
    assert batch.position_ids.tolist() == expected_positions
    assert batch.episode_ids.tolist() == [0] * sum(lengths)
    assert batch.segment_ids.tolist() == [i for i, n in enumerate(lengths) for _ in range(n)]
    assert batch.num_episodes == 1 and batch.group_ids.tolist() == [3]
    assert batch.loss_mask.sum().item() == trajectory.num_action_tokens


def test_without_a_summarizer_the_same_episode_ends_at_max_context(codec):
    engine = ScriptedEngine(codec, {"*": [ACTION]})
    budget = EpisodeBudget(max_turns=8, max_context_tokens=400)
    trajectory = asyncio.run(run_episode(engine=engine, env=CountingEnv(observation_chars=120), codec=codec,
                                         sampling=SAMPLING, budget=budget, episode_id="ep", task_id="t", group_id=0))
    assert trajectory.termination is TerminationReason.MAX_CONTEXT
    assert len(trajectory.segments) == 1


def test_make_summarizer_none_and_unknown(codec):
    assert make_summarizer("none", codec) is None
    with pytest.raises(ValueError, match="env.summarizer"):
        make_summarizer("llm", codec)
