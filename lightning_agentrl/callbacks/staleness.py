"""Staleness-weighted importance correction (SPEC §6): per-token lag, weight, hard bound, histogram.

Every token records the policy version that sampled it. At optimizer step k its lag is
``k - version``. Tokens get a weight ``w(lag)`` (none, exp or inverse decay) that multiplies their
loss; an episode whose oldest token lags more than ``max_staleness`` leaves the loss (and the
group baseline) and is counted. The module itself applies decoupled PPO (proximal = the weights
before this step, truncated importance weight proximal/behavior) whenever a lag is positive.
"""

from __future__ import annotations

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl.algorithms import staleness
from lightning_agentrl.distributed import reduce_metrics
from lightning_agentrl.trajectory import RolloutBatch


class StalenessWeighting(L.Callback):
    def __init__(self, kind: str = "none", rate: float = 0.0, max_staleness: int | None = None) -> None:
        staleness.check_staleness_kind(kind)
        if rate < 0:
            raise ValueError(f"rate must be >= 0, got {rate}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0 or None, got {max_staleness}")
        self.kind, self.rate, self.max_staleness = kind, rate, max_staleness
        self.num_dropped = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        lag = staleness.lag(batch.policy_versions, trainer.global_step)
        batch.token_weights = batch.token_weights * staleness.staleness_weight(lag, self.kind, self.rate)
        episode_lag = staleness.trajectory_lag(lag, batch.episode_ids, batch.num_episodes)
        keep, counts = staleness.apply_staleness_bound(episode_lag, self.max_staleness)
        batch.include &= keep
        sampled = lag >= 0
        metrics = dict(counts)
        if sampled.any():
            weights = batch.token_weights[sampled]
            metrics["staleness/weight_mean"] = float(weights.mean())
            metrics["staleness/weight_min"] = float(weights.min())
            for value, count in zip(*torch.unique(lag[sampled], return_counts=True), strict=True):
                metrics[f"staleness/tokens_lag_{int(value)}"] = float(count)
        # the step over all ranks: counts summed, extremes kept, means averaged
        metrics = reduce_metrics(
            metrics,
            sums=lambda key: key.startswith(("staleness/num_", "staleness/tokens_lag_")),
            maxima={"staleness/max_lag"},
            minima={"staleness/weight_min"},
        )
        self.num_dropped += int(metrics["staleness/num_dropped"])
        metrics["staleness/num_dropped_total"] = float(self.num_dropped)
        pl_module.log_dict(metrics, on_step=True, batch_size=batch.num_episodes)
        pl_module.log("lag", metrics["staleness/max_lag"], prog_bar=True, on_step=True, batch_size=batch.num_episodes)

    @override
    def state_dict(self) -> dict:
        return {"num_dropped": self.num_dropped}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_dropped = state_dict["num_dropped"]
