"""The SPEC §7 checks, every step: rewards, empty-signal groups, termination reasons, masks.

Computed over *all* episodes of the batch, including those a filter excluded from the loss, and
watched for the Echo Trap (within-group reward std collapsing, then a grad-norm spike). With
several training processes the metrics are reduced over ranks (counts summed, rates averaged).
The trajectories themselves are saved by :class:`~lightning_agentrl.callbacks.trajectory_archive.TrajectoryArchive`.
"""

from __future__ import annotations

from collections import Counter

import lightning as L
from typing_extensions import override

from lightning_agentrl.algorithms.advantages import group_reward_stats
from lightning_agentrl.algorithms.diagnostics import echo_trap_warning
from lightning_agentrl.distributed import reduce_metrics
from lightning_agentrl.trajectory import RolloutBatch, TerminationReason


class RolloutMetrics(L.Callback):
    def __init__(self, service=None) -> None:
        self.service = service
        self._within_group_std: list[float] = []
        self._grad_norms: list[float] = []
        self._warned = False

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        trajectories = batch.trajectories
        metrics = group_reward_stats(batch.rewards.float().cpu(), batch.group_ids.cpu())
        reasons = Counter(t.termination.value for t in trajectories)
        for reason in TerminationReason:
            metrics[f"termination/{reason.value}"] = float(reasons.get(reason.value, 0))
        num_tokens = sum(t.num_tokens for t in trajectories)
        metrics["tokens/action_frac"] = sum(t.num_action_tokens for t in trajectories) / max(num_tokens, 1)
        metrics["tokens/per_episode"] = num_tokens / len(trajectories)
        metrics["episode/turns_mean"] = float(batch.num_turns.float().mean())
        metrics["episode/seconds_mean"] = sum(t.timings.get("episode_s", 0.0) for t in trajectories) / len(trajectories)
        if self.service is not None:
            metrics.update(self.service.metrics())
        metrics = reduce_metrics(metrics, sums=lambda key: key.startswith(("termination/", "rollout/", "groups/num")))
        if "rollout/in_flight" in metrics:
            pl_module.log("in_flight", metrics["rollout/in_flight"], prog_bar=True, on_step=True, batch_size=1)
        pl_module.log_dict(metrics, on_step=True, batch_size=len(trajectories))
        pl_module.log("reward", metrics["reward/mean"], prog_bar=True, on_step=True, batch_size=len(trajectories))

        self._within_group_std.append(metrics["reward/within_group_std"])

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        grad_norm = trainer.callback_metrics.get("policy/grad_norm")  # absent on a skipped step
        warning = self.record_grad_norm(float(grad_norm) if grad_norm is not None else None)
        if warning:
            from lightning.pytorch.utilities import rank_zero_warn

            rank_zero_warn(warning)

    def record_grad_norm(self, grad_norm: float | None) -> str | None:
        """Add this step's gradient norm (after its reward std) and return the Echo Trap warning,
        the first time it fires, with the grad-norm spike that follows the collapse when there is one."""
        if grad_norm is not None:
            self._grad_norms.append(grad_norm)
        warning = echo_trap_warning(self._within_group_std, grad_norm_history=self._grad_norms)
        if not warning or self._warned:
            return None
        self._warned = True
        return warning

    @override
    def state_dict(self) -> dict:
        return {"within_group_std": list(self._within_group_std), "grad_norms": list(self._grad_norms),
                "warned": self._warned}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self._within_group_std = list(state_dict["within_group_std"])
        self._grad_norms = list(state_dict.get("grad_norms", []))  # absent in checkpoints of older runs
        self._warned = state_dict["warned"]
