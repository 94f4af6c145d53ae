"""Token in, token out, checked on every batch (SPEC §5).

Before a batch is trained on, every action span must hash to the digest the agent loop took of
the engine's output, carry loss mask 1 and a behavior log-prob, and no other token may carry
mask 1. A mismatch stops the run with the episode and turn named: training on ids that were
never sampled would silently corrupt credit assignment.
"""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from lightning_agentrl.distributed import global_sum
from lightning_agentrl.trajectory import RolloutBatch, check_token_in_token_out


class TokenCheck(L.Callback):
    def __init__(self) -> None:
        self.num_turns_checked = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        (checked,) = global_sum(check_token_in_token_out(batch))  # every rank's turns of the step
        self.num_turns_checked += int(checked)
        pl_module.log("tokens/turns_checked", float(self.num_turns_checked), on_step=True, batch_size=1)

    @override
    def state_dict(self) -> dict:
        return {"num_turns_checked": self.num_turns_checked}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_turns_checked = state_dict["num_turns_checked"]
