"""check_token_in_token_out: recorded action ids must be the engine's output, and only they carry mask 1."""

from __future__ import annotations

import asyncio

import pytest

from lightning_agentrl.rollout.agent_loop import (
    EpisodeBudget,
    TokenMismatchError,
    check_token_in_token_out,
    run_episode,
)
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.trajectory import pack
from tests.rollout.conftest import CountingEnv, ScriptedEngine, call


@pytest.fixture
def trajectory(codec):
    engine = ScriptedEngine(codec, {"*": [call("run", command="ls")]})
    return asyncio.run(run_episode(engine=engine, env=CountingEnv(), codec=codec, sampling=SamplingParams(seed=0),
                                   budget=EpisodeBudget(max_turns=3), episode_id="ep", task_id="t", group_id=0))


def test_a_clean_batch_passes(trajectory):
    assert check_token_in_token_out(pack([trajectory, trajectory.model_copy(deep=True)])) == 6


def test_a_changed_action_id_is_caught(trajectory):
    segment = trajectory.segments[0]
    segment.token_ids[segment.turns[1].action_start] += 1  # e.g. an action decoded and re-encoded
    with pytest.raises(TokenMismatchError, match="turn 1"):
        check_token_in_token_out([trajectory])


def test_mask_1_outside_an_action_is_caught(trajectory):
    trajectory.segments[0].loss_mask[0] = 1  # a prompt token marked as trained
    with pytest.raises(TokenMismatchError, match="outside any action"):
        check_token_in_token_out([trajectory])


def test_digests_survive_the_json_round_trip(trajectory):
    from lightning_agentrl.trajectory import Trajectory

    assert check_token_in_token_out([Trajectory.model_validate_json(trajectory.model_dump_json())]) == 3
