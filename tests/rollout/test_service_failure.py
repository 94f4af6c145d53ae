"""A failure inside the rollout service reaches the trainer as itself, and stopping afterwards is quiet."""

from __future__ import annotations

import pytest
import torch

from lightning_agentrl.rollout.buffer import RolloutServiceError
from lightning_agentrl.rollout.service import RolloutPlan
from tests.rollout.conftest import ScriptedEngine, call, counting_service


class RefusingEngine(ScriptedEngine):
    async def update_weights(self, named_tensors, version):
        raise KeyError("update_weights: the engine's model has no parameter 'lm_head.weight'")


def test_stop_after_the_loop_died_keeps_the_cause(codec, task):
    service = counting_service(codec, [task], RefusingEngine(codec, {"*": [call("submit")]}), RolloutPlan(group_size=2, groups_per_step=1, max_in_flight=2, max_staleness=0), submit_at=1, max_turns=2, max_new_tokens=16)
    service.start(initial_weights=[("lm_head.weight", torch.zeros(1))], version=0)
    with pytest.raises(RolloutServiceError) as caught:
        service.take_batch(0, timeout_s=30)
    assert "lm_head.weight" in repr(caught.value.__cause__)
    service._thread.join(timeout=30)  # the loop has ended and closed
    assert service._loop.is_closed()
    service.stop()  # was: RuntimeError("Event loop is closed"), raised over the cause
