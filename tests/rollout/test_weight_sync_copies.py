"""A weight sync hands the engine the tensors it was given: no second full copy of the weights per sync."""

from __future__ import annotations

import torch

from lightning_agentrl.rollout.service import RolloutPlan
from tests.rollout.conftest import ScriptedEngine, call, counting_service


class KeepingEngine(ScriptedEngine):
    async def update_weights(self, named_tensors, version):
        self.received = list(named_tensors)
        self.policy_version = version


def test_a_weight_sync_passes_the_callers_tensors_without_copying_them(codec, task):
    engine = KeepingEngine(codec, {"*": [call("submit")]})
    plan = RolloutPlan(group_size=2, groups_per_step=1, max_in_flight=2, max_staleness=0)
    service = counting_service(codec, [task], engine, plan, submit_at=1, max_turns=2, max_new_tokens=16)
    service.start(initial_weights=[("w", torch.zeros(4))], version=0)
    try:
        service.take_batch(0, timeout_s=60)
        weights = torch.ones(1000)
        service.update_weights([("w", weights)], version=1)
        ((name, tensor),) = engine.received
        assert name == "w" and tensor.data_ptr() == weights.data_ptr()  # the same storage, not a clone
        assert engine.policy_version == 1
    finally:
        service.stop()
