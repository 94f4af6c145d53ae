"""The buffer hands out whole groups: none lost on a timeout, stale and signal-free ones counted."""

from __future__ import annotations

import threading

import pytest

from lightning_agentrl.rollout.buffer import RolloutBuffer
from lightning_agentrl.trajectory import Segment, TerminationReason, Trajectory


def group(group_id: int, rewards=(1.0, 0.0), version: int = 0) -> list[Trajectory]:
    episodes = []
    for i, reward in enumerate(rewards):
        segment = Segment()
        segment.extend([1, 2], mask=0)
        segment.extend([3], mask=1, logprobs=[-1.0], version=version)
        episodes.append(Trajectory(episode_id=f"g{group_id}-e{i}", task_id="t", group_id=group_id, reward=reward,
                                   termination=TerminationReason.SUBMITTED, segments=[segment]))
    return episodes


def ids(groups) -> list[int]:
    return [g[0].group_id for g in groups]


def test_a_take_that_times_out_keeps_the_groups_it_had_taken():
    buffer = RolloutBuffer(max_staleness=0)
    buffer.put(group(0))
    with pytest.raises(TimeoutError):
        buffer.take(2, policy_version=0, timeout_s=0.05)
    assert len(buffer) == 1  # group 0 waits for the next take
    buffer.put(group(1))
    assert ids(buffer.take(2, policy_version=0, timeout_s=1)) == [0, 1]


def test_a_take_woken_by_a_failure_keeps_the_groups_it_had_taken():
    from lightning_agentrl.rollout.buffer import RolloutServiceError

    buffer = RolloutBuffer(max_staleness=0)
    buffer.put(group(0))
    threading.Timer(0.05, buffer.fail, args=(RuntimeError("engine died"),)).start()
    with pytest.raises(RolloutServiceError):
        buffer.take(2, policy_version=0, timeout_s=5)
    assert len(buffer) == 1


def test_dropped_groups_are_counted_as_removed_and_announced():
    buffer = RolloutBuffer(max_staleness=1)
    changes = []
    buffer.on_change = lambda: changes.append((buffer.num_removed, buffer.starved))
    buffer.put(group(0, version=0))  # lag 2 at version 2: dropped
    buffer.put(group(1, version=1))
    assert ids(buffer.take(1, policy_version=2, timeout_s=1)) == [1]
    assert buffer.num_dropped_stale == 1 and buffer.num_removed == 1
    assert changes == [(1, False)]
    with pytest.raises(TimeoutError):
        buffer.take(1, policy_version=2, timeout_s=0.01)
    assert changes[-1] == (1, True)  # a take that waits says so: parked episodes may need to go on
    assert not buffer.starved


def test_dynamic_sampling_trains_only_groups_with_reward_variance():
    buffer = RolloutBuffer(max_staleness=0, dynamic_sampling=True, max_sampling_rounds=3)
    for group_id, rewards in enumerate([(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 0.0)]):
        buffer.put(group(group_id, rewards))
    assert ids(buffer.take(2, policy_version=0, timeout_s=1)) == [1, 3]
    assert buffer.num_discarded == 2 and buffer.num_removed == 2 and buffer.num_filled == 0
    assert buffer.last_take == {"discarded": 2, "filled": 0}


def test_dynamic_sampling_fills_with_the_newest_groups_when_the_budget_is_spent():
    buffer = RolloutBuffer(max_staleness=0, dynamic_sampling=True, max_sampling_rounds=2)
    for group_id, rewards in enumerate([(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (1.0, 1.0), (1.0, 0.0)]):
        buffer.put(group(group_id, rewards))
    # 2 rounds of 2 groups: 0, 1, 2, 3 are looked at; one group with variance, then the newest discarded one
    assert ids(buffer.take(2, policy_version=0, timeout_s=1)) == [1, 3]
    assert buffer.num_discarded == 2 and buffer.num_filled == 1
    assert buffer.last_take == {"discarded": 2, "filled": 1}
    assert len(buffer) == 1


def test_counters_survive_a_checkpoint():
    buffer = RolloutBuffer(max_staleness=0, dynamic_sampling=True, max_sampling_rounds=2)
    buffer.put(group(0, (1.0, 1.0)))
    buffer.put(group(1))
    buffer.take(1, policy_version=0, timeout_s=1)
    restored = RolloutBuffer(max_staleness=0, dynamic_sampling=True)
    restored.load_state_dict(buffer.state_dict())
    assert (restored.num_discarded, restored.num_removed) == (1, 1)
