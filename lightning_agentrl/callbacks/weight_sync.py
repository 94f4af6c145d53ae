"""Push the trained weights to the generation engine and bump the policy version.

The policy version is the number of optimizer steps behind the weights, so after step k the
engine serves version k and every token it samples records k. Under LoRA only the adapters travel
(lightning_agentrl/lora.py).
"""

from __future__ import annotations

import time

import lightning as L
from typing_extensions import override


class WeightSync(L.Callback):
    def __init__(self, service, every_n_steps: int = 1) -> None:
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.service = service
        self.every_n_steps = every_n_steps
        self.num_syncs = 0
        self.seconds = 0.0  # gathering and pushing weights, summed over the run (stage timings)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        step = trainer.global_step
        if pl_module.last_step_skipped:
            return  # no optimizer step, no new weights (EmptyStepGuard lets the service go on)
        if step % self.every_n_steps != 0 or step >= (trainer.max_steps if trainer.max_steps > 0 else step + 1):
            return  # no sync after the final step: nothing would use it
        # every rank gathers (a collective under ZeRO-3); rank 0's copy feeds the engine
        started = time.perf_counter()
        self.service.sync_weights(pl_module.policy, version=step)
        self.seconds += time.perf_counter() - started
        self.num_syncs += 1
        pl_module.log("rollout/policy_version", float(step), on_step=True, batch_size=1)

    @override
    def state_dict(self) -> dict:
        return {"num_syncs": self.num_syncs}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_syncs = state_dict["num_syncs"]
