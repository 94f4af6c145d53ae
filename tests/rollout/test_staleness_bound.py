"""The staleness bound holds under a slow trainer, and a bound > 0 lets generation run ahead."""

from __future__ import annotations

import asyncio
import time

import pytest

from lightning_agentrl.rollout.service import RolloutPlan
from tests.rollout.conftest import ScriptedEngine, call, counting_service

NUM_STEPS = 5
GROUPS_PER_STEP = 2


@pytest.mark.parametrize("max_staleness", [0, 2])
def test_every_token_is_within_the_staleness_bound_under_a_slow_trainer(codec, task, max_staleness):
    engine = ScriptedEngine(codec, {"*": [call("run", command="ls"), call("submit")]}, delay_s=0.005)
    service = counting_service(codec, [task], engine, RolloutPlan(group_size=2, groups_per_step=GROUPS_PER_STEP, max_in_flight=8, max_staleness=max_staleness), submit_at=2)
    most_ahead = 0
    with service:
        for step in range(NUM_STEPS):
            batch = service.take_batch(step, timeout_s=30)
            assert len(batch) == 2 * GROUPS_PER_STEP
            lags = [step - v for t in batch for s in t.segments for v in s.policy_versions if v >= 0]
            assert lags and max(lags) <= max_staleness and min(lags) >= 0
            if max_staleness == 0:
                assert set(lags) == {0}  # synchronous: batch k is all version k
            time.sleep(0.3)  # the slow trainer
            consumed = (step + 1) * GROUPS_PER_STEP
            most_ahead = max(most_ahead, service.num_groups_finished - consumed)
            service.update_weights([], step + 1)
    assert service.buffer.num_dropped_stale == 0  # the gate, not the drop, kept the bound
    if max_staleness == 0:
        assert most_ahead == 0
    else:  # generation overlapped training: finished groups waited for the trainer
        assert most_ahead >= GROUPS_PER_STEP


def test_groups_dropped_as_stale_are_replaced_so_generation_keeps_running_ahead(codec, task):
    """Groups 0 and 1 finish long after the trainer moved past the bound and are dropped; the service
    starts a replacement for each, so afterwards it still runs ``max_staleness`` steps ahead."""
    async def slow_first_groups(session_id, index):
        if session_id.startswith(("g0-", "g1-")):
            await asyncio.sleep(2.0)

    engine = ScriptedEngine(codec, {"*": [call("submit")]}, before_request=slow_first_groups)
    service = counting_service(codec, [task], engine, RolloutPlan(group_size=2, groups_per_step=1, max_in_flight=8, max_staleness=2), submit_at=1)
    ready_before_take = []
    with service:
        for step in range(14):
            time.sleep(0.25)  # the slow trainer: generation has time to run ahead
            ready_before_take.append(len(service.buffer))
            batch = service.take_batch(step, timeout_s=30)
            assert {t.group_id for t in batch} & {0, 1} == set()
            service.update_weights([], step + 1)
    assert service.buffer.num_dropped_stale == 2
    # After the drops (about 2 s in) the trainer at version v again finds groups v .. v + max_staleness
    # ready; without replacements the two dropped groups would use up two of those three places.
    assert ready_before_take[-3:] == [3, 3, 3], ready_before_take
