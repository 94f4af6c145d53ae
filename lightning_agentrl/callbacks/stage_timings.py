"""Where each training step's time goes, logged every step: ``time/<stage>_s``, tokens per second and,
on CUDA, the model FLOP utilization.

Trainer stages (disjoint intervals of one step, so they sum to at most ``time/step_s``):

- ``time/wait_rollouts_s``: from the end of the previous step (or the start of training) until the
  batch reaches the trainer (the rollout service producing it, or handing over a ready one);
- ``time/forward_backward_s``: the training step (forward, loss, backward) without the optimizer;
- ``time/optimizer_s``: the optimizer updates (clipping, the step, DeepSpeed's included, zeroing the
  gradients: ``AgentRLModule.optimizer_s``);
- ``time/weight_sync_s``: gathering the weights and pushing them to the engine (:class:`WeightSync`);
- ``time/checkpoint_s``: saving a checkpoint (:class:`~lightning_agentrl.checkpoint_io.StepCheckpoint`);
- ``time/step_s``: the step's wall time, end of the previous step to the end of this one.

Rollout stages, per episode of the step's batch (mean over its episodes, from ``Trajectory.timings``;
episodes run concurrently and, with ``rollout.max_staleness`` > 0, during earlier steps; with several
processes, rank 0's episodes): ``time/generation_s``, ``time/environment_s`` (every environment step,
*including* the final one that ran the hidden checks) and ``time/scoring_s`` (that final step alone:
a part of ``time/environment_s``, not an addition to it; ``environment_s - scoring_s`` is the tools).

``throughput/tokens_per_s``: the step's tokens (every segment's ids) over ``time/step_s``, summed over
all processes (the whole run's rate; each rank trains its own share of the batch).
``throughput/mfu`` (CUDA only): per device, ``6 * parameters * tokens`` over the forward/backward and
optimizer time, as a fraction of one device's peak FLOP/s for the training precision (Lightning's
table), with ``tokens`` a device's mean share (the summed tokens over the number of processes).

A step's numbers are complete only once the checkpoint callback (always the last) has run, so they are
logged at the start of the next step, or at the end of training, under the step's own index: the step
every other metric of its batch is logged at (0 for the first batch). The final checkpoint written at the
end of training comes after the last step and is not counted.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl.callbacks.weight_sync import WeightSync
from lightning_agentrl.checkpoint_io import StepCheckpoint


class StageTimings(L.Callback):
    """Put it early in the callback list: its ``on_train_batch_end`` marks the end of the training step."""

    def __init__(self) -> None:
        self._pending: dict[str, float] | None = None
        self._step_index = 0
        self._previous_end = 0.0
        self._optimizer_before = 0.0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._sync = next((c for c in trainer.callbacks if isinstance(c, WeightSync)), None)
        self._checkpoint = next((c for c in trainer.callbacks if isinstance(c, StepCheckpoint)), None)
        self._peak_flops = _peak_flops(trainer, pl_module)
        self._num_params = sum(getattr(p, "ds_numel", p.numel()) for p in pl_module.parameters())
        self._previous_end = time.perf_counter()

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        self._flush(trainer)
        # the step Lightning logs this batch's other metrics at (it counts batches, skipped ones too)
        self._step_index = getattr(trainer.fit_loop.epoch_loop, "_batches_that_stepped", trainer.global_step)
        self._started = now
        self._optimizer_before = getattr(pl_module, "optimizer_s", 0.0)
        self._sync_before = self._sync.seconds if self._sync else 0.0
        self._checkpoint_before = self._checkpoint.seconds if self._checkpoint else 0.0
        self._wait_s = now - self._previous_end

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        train_s = time.perf_counter() - self._started
        trajectories = getattr(batch, "trajectories", [])
        optimizer_s = getattr(pl_module, "optimizer_s", 0.0) - self._optimizer_before
        self._pending = {
            "time/wait_rollouts_s": self._wait_s,
            "time/forward_backward_s": train_s - optimizer_s,
            "time/optimizer_s": optimizer_s,
            **_rollout_means(trajectories),
            "tokens": float(sum(t.num_tokens for t in trajectories)),
        }

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._flush(trainer)

    def _flush(self, trainer: L.Trainer) -> None:
        """Log the previous step, now that its weight sync and checkpoint are done."""
        if self._pending is None:
            return
        metrics, self._pending = self._pending, None
        end = self._checkpoint.batch_end_at if self._checkpoint and self._checkpoint.batch_end_at else time.perf_counter()
        step_s = end - self._previous_end
        self._previous_end = end
        metrics["time/weight_sync_s"] = (self._sync.seconds if self._sync else 0.0) - self._sync_before
        metrics["time/checkpoint_s"] = (self._checkpoint.seconds if self._checkpoint else 0.0) - self._checkpoint_before
        metrics["time/step_s"] = step_s
        tokens = _sum_over_ranks(trainer, metrics.pop("tokens"))  # a collective: every rank flushes
        metrics["throughput/tokens_per_s"] = tokens / step_s
        compute_s = metrics["time/forward_backward_s"] + metrics["time/optimizer_s"]
        if self._peak_flops and compute_s > 0:
            per_device = tokens / trainer.world_size
            metrics["throughput/mfu"] = 6 * self._num_params * per_device / compute_s / self._peak_flops
        if trainer.logger is not None and trainer.is_global_zero:
            trainer.logger.log_metrics(metrics, step=self._step_index)


def _sum_over_ranks(trainer: L.Trainer, value: float) -> float:
    """``value`` summed over the run's processes (float64: token counts stay exact)."""
    if trainer.world_size == 1:
        return value
    total = torch.tensor(value, dtype=torch.float64, device=trainer.strategy.root_device)
    return float(trainer.strategy.reduce(total, reduce_op="sum"))


def _rollout_means(trajectories) -> dict[str, float]:
    if not trajectories:
        return {}
    stages = {"generation_s": "time/generation_s", "tool_s": "time/environment_s", "scoring_s": "time/scoring_s"}
    return {
        name: sum(t.timings.get(key, 0.0) for t in trajectories) / len(trajectories) for key, name in stages.items()
    }


def _peak_flops(trainer: L.Trainer, pl_module: L.LightningModule) -> float | None:
    """The device's peak FLOP/s at the training precision; None off CUDA or for an unknown chip."""
    if pl_module.device.type != "cuda":
        return None
    from lightning.fabric.utilities.throughput import get_available_flops

    precision = str(trainer.precision)
    dtype = torch.bfloat16 if "bf16" in precision else torch.float16 if precision.startswith("16") else torch.float32
    flops = get_available_flops(pl_module.device, dtype)
    return float(flops) if flops else None
