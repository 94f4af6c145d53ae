"""StarPO-S group filtering (RAGEN, https://arxiv.org/abs/2504.20073): train only on the groups
whose rewards disagree most.

Keeps the ``keep_fraction`` of groups with the highest within-group reward std; the others leave
the loss. It fights the Echo Trap, where groups stop disagreeing and the gradient turns to noise.
"""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from lightning_agentrl.algorithms.advantages import starpo_s_keep
from lightning_agentrl.distributed import reduce_metrics
from lightning_agentrl.trajectory import RolloutBatch


class GroupFilter(L.Callback):
    def __init__(self, keep_fraction: float) -> None:
        if not 0 < keep_fraction <= 1:
            raise ValueError(f"keep_fraction must be in (0, 1], got {keep_fraction}")
        self.keep_fraction = keep_fraction
        self.num_groups_dropped = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch) or self.keep_fraction == 1:
            return
        keep = starpo_s_keep(batch.rewards, batch.group_ids, self.keep_fraction)
        dropped_groups = batch.group_ids[~keep].unique().numel()
        batch.include &= keep
        # groups are ranked within each rank's share of the step (docs/scaling.md); counts are summed
        metrics = reduce_metrics(
            {"filter/starpo_groups_dropped": float(dropped_groups), "filter/starpo_kept_frac": float(keep.float().mean())},
            sums={"filter/starpo_groups_dropped"},
        )
        self.num_groups_dropped += int(metrics["filter/starpo_groups_dropped"])
        pl_module.log_dict(metrics, on_step=True, batch_size=batch.num_episodes)

    @override
    def state_dict(self) -> dict:
        return {"num_groups_dropped": self.num_groups_dropped}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_groups_dropped = state_dict["num_groups_dropped"]
