"""Several training processes: each rank's rollout service produces whole groups of its own, and
together the ranks draw the groups (tasks, episode ids, hence sampling seeds) one process would."""

from __future__ import annotations

import pytest

from lightning_agentrl.rollout.service import RolloutPlan, RolloutService
from lightning_agentrl.tasks import load_tasks
from tests.rollout.conftest import REPO, ScriptedEngine, call, counting_service

STEPS, GROUPS_PER_STEP, GROUP_SIZE = 2, 4, 2


def make_service(codec, tasks) -> RolloutService:
    return counting_service(codec, tasks, ScriptedEngine(codec, {"*": [call("submit")]}), RolloutPlan(group_size=GROUP_SIZE, groups_per_step=GROUPS_PER_STEP, max_in_flight=8, max_staleness=0), submit_at=1, max_turns=2)


def batches(service: RolloutService) -> list[set[tuple[int, str, str]]]:
    """Per step: (group id, task id, episode id) of every trajectory."""
    out = []
    with service:
        for step in range(STEPS):
            batch = service.take_batch(step, timeout_s=30)
            out.append({(t.group_id, t.task_id, t.episode_id) for t in batch})
            service.update_weights([], step + 1)
    return out


def test_ranks_together_draw_the_groups_of_one_process(codec):
    tasks = load_tasks(REPO / "tasks" / "bugfix")[:5]
    alone = batches(make_service(codec, tasks))
    ranks = []
    for rank in range(2):
        service = make_service(codec, tasks)
        service.shard(rank, 2)
        assert service.plan.groups_per_step == GROUPS_PER_STEP // 2
        ranks.append(batches(service))
    for step in range(STEPS):
        mine, theirs = ranks[0][step], ranks[1][step]
        groups = [{g for g, _, _ in mine}, {g for g, _, _ in theirs}]
        assert not groups[0] & groups[1]  # no group is split or shared between ranks
        assert all(g % 2 == rank for rank in range(2) for g in groups[rank])
        assert len(mine) == len(theirs) == GROUP_SIZE * GROUPS_PER_STEP // 2  # whole groups
        assert mine | theirs == alone[step]  # same groups, tasks and episode ids as one process


def test_a_step_that_cannot_be_split_into_whole_groups_is_refused(codec, task):
    service = make_service(codec, [task])
    with pytest.raises(ValueError, match=r"groups_per_step \(4\) must be a multiple .*\(3\)"):
        service.shard(0, 3)
    service.shard(1, 2)
    service.shard(1, 2)  # idempotent: the share is computed from the step's total
    assert service.plan.groups_per_step == 2
