"""Partial rollouts: an episode over its time budget is parked and continued with newer weights."""

from __future__ import annotations

import asyncio
import time

import pytest

from lightning_agentrl.envs.coding import CodingEnv
from lightning_agentrl.rollout.agent_loop import EpisodeBudget, check_token_in_token_out
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.rollout.service import RolloutPlan, RolloutService
from lightning_agentrl.trajectory import TerminationReason
from sandbox_client import SandboxClient
from tests.rollout.conftest import ScriptedEngine, call

# Group 0 needs two steps (read, submit): it is parked after the first. The other groups submit at once.
SCRIPT = {"g0": [call("read_file", path="search.py"), call("submit")], "*": [call("submit")]}


def make_service(server, codec, task, engine, *, partial_rollout_s: float | None, max_staleness: int = 2,
                 groups_per_step: int = 1):
    return RolloutService(
        engine=engine,
        make_client=lambda: SandboxClient(server.url, server.token),
        make_env=lambda client, task: CodingEnv(client, task),
        codec=codec,
        tasks=[task],
        sampling=SamplingParams(max_new_tokens=128, seed=0),
        budget=EpisodeBudget(max_turns=4),
        plan=RolloutPlan(group_size=2, groups_per_step=groups_per_step, max_in_flight=8, max_staleness=max_staleness,
                         partial_rollout_s=partial_rollout_s),
    )


def train_until_group(service, group_id: int, first_step: int = 0, max_steps: int = 5):
    """Take one group per step and push a new version after each, until ``group_id`` comes out."""
    for step in range(first_step, first_step + max_steps):
        batch = service.take_batch(step, timeout_s=60)
        service.update_weights([], step + 1)
        if batch[0].group_id == group_id:
            return batch, step
    raise AssertionError(f"group {group_id} never came out")


def versions(trajectory) -> set[int]:
    return {v for segment in trajectory.segments for v in segment.policy_versions if v >= 0}


def wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting for the rollout service"
        time.sleep(0.02)


def test_a_parked_episode_resumes_with_newer_weights(sandbox_server, codec, task):
    async def slow_short_groups(session_id, index):  # group 0's resumed turn finishes before group 2
        if not session_id.startswith("g0-"):
            await asyncio.sleep(3.0)  # a margin for a busy machine (the other groups' sandbox calls)

    engine = ScriptedEngine(codec, SCRIPT, before_request=slow_short_groups)
    with make_service(sandbox_server, codec, task, engine, partial_rollout_s=0.0, max_staleness=1) as service:
        batch, step = train_until_group(service, 0)
    assert step == 1  # group 1 trained at step 0, then group 0 with versions 0 and 1
    for trajectory in batch:
        assert trajectory.termination is TerminationReason.SUBMITTED
        assert trajectory.info["num_parks"] == 1
        assert versions(trajectory) == {0, 1}  # turn 1 by version 0, turn 2 (after the park) by version 1
        assert [turn.tool for turn in trajectory.turns] == ["read_file", "submit"]
    assert check_token_in_token_out(batch) == 4
    assert service.num_parks == 2 and service.buffer.num_dropped_stale == 0


def test_parked_episodes_go_on_when_a_finished_group_leaves_the_trainer_waiting(sandbox_server, codec, task):
    """Two groups per step: group 0 submits at once but last; the other groups are parked after one
    turn. When group 0 reaches the buffer the trainer still waits for a second group, the gate is
    closed and every other episode is parked: they must go on with the current weights."""
    async def group_zero_last(session_id, index):
        if session_id.startswith("g0-"):
            await asyncio.sleep(2.5)

    script = {"g0": [call("submit")], "*": [call("read_file", path="search.py"), call("submit")]}
    engine = ScriptedEngine(codec, script, before_request=group_zero_last)
    with make_service(sandbox_server, codec, task, engine, partial_rollout_s=0.0, max_staleness=1,
                      groups_per_step=2) as service:
        for step in range(2):
            batch = service.take_batch(step, timeout_s=20)
            assert len(batch) == 4 and all(t.termination is TerminationReason.SUBMITTED for t in batch)
            service.update_weights([], step + 1)
    assert service.num_parks >= 4


def test_partial_rollouts_need_a_staleness_allowance(sandbox_server, codec, task):
    with pytest.raises(ValueError, match="max_staleness"):
        make_service(sandbox_server, codec, task, ScriptedEngine(codec, SCRIPT), partial_rollout_s=1.0,
                     max_staleness=0)


def test_parked_episodes_survive_a_checkpoint_and_a_lost_sandbox_ends_as_sandbox_error(sandbox_server, codec, task):
    first = make_service(sandbox_server, codec, task, ScriptedEngine(codec, SCRIPT), partial_rollout_s=0.0)
    with first:
        wait_until(lambda: first.num_parked == 2 and first.num_groups_finished == 2)
        state = first.state_dict()
    parked = state["groups"]["0"]["parked"]
    assert sorted(parked) == ["0", "1"] and state["restart"] == [0]
    sandbox_ids = [parked[i]["env_state"]["sandbox_id"] for i in ("0", "1")]
    assert all(sandbox_ids)

    async def delete(sandbox_id):
        async with SandboxClient(sandbox_server.url, sandbox_server.token) as client:
            await client.delete(sandbox_id)

    asyncio.run(delete(sandbox_ids[1]))  # episode 1's sandbox is gone when the run resumes

    resumed_script = {"g0": [call("read_file", path="search.py"), call("submit")], "*": [call("submit")]}
    # The restored ready groups (1, 2) come out first; a wide bound keeps group 0 from being dropped as stale.
    second = make_service(sandbox_server, codec, task, ScriptedEngine(codec, resumed_script), partial_rollout_s=None,
                          max_staleness=8)
    second.load_state_dict(state)
    with second:
        second.update_weights([], 1)
        batch, _ = train_until_group(second, 0, first_step=1, max_steps=8)
    kept, lost = batch
    # version 0 before the checkpoint; after it, whichever versions the (fast) trainer had pushed by then
    assert kept.termination is TerminationReason.SUBMITTED
    assert min(versions(kept)) == 0 and len(versions(kept)) >= 2
    assert kept.turns[0].tool == "read_file" and len(kept.turns) == 3  # 1 before the checkpoint, 2 after
    assert lost.termination is TerminationReason.SANDBOX_ERROR and "SandboxNotFound" in lost.info["sandbox_error"]
    check_token_in_token_out(batch)
    assert second.buffer.num_dropped_stale == 0
