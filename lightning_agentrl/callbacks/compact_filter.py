"""Compact filtering (DeepSWE): drop truncated and broken episodes from the loss.

An excluded episode leaves the group baseline as well as the loss (``batch.include``), and still
appears in every rollout metric. Infrastructure errors (``sandbox_error``, ``engine_error``) are
always excluded (SPEC §4: the model is not punished for the environment's faults); truncations (max_turns, max_context, timeout) only when
``reasons`` lists them, i.e. with ``rollout.truncation: filter``.
"""

from __future__ import annotations

from collections import Counter

import lightning as L
import torch
from typing_extensions import override

from lightning_agentrl.distributed import reduce_metrics
from lightning_agentrl.trajectory import RolloutBatch, TerminationReason

TRUNCATIONS = (TerminationReason.MAX_TURNS, TerminationReason.MAX_CONTEXT, TerminationReason.TIMEOUT)
INFRASTRUCTURE = tuple(reason for reason in TerminationReason if reason.infrastructure)


class CompactFilter(L.Callback):
    def __init__(self, reasons: tuple[TerminationReason | str, ...] = INFRASTRUCTURE) -> None:
        self.reasons = frozenset(TerminationReason(r) for r in reasons)
        self._total: Counter[str] = Counter()

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        excluded = [t.termination in self.reasons for t in batch.trajectories]
        batch.include &= ~torch.tensor(excluded, dtype=torch.bool, device=batch.include.device)
        step: Counter[str] = Counter(
            t.termination.value for t, out in zip(batch.trajectories, excluded, strict=True) if out
        )
        self._total.update(step)
        metrics = {f"filter/excluded_{reason.value}": float(step.get(reason.value, 0)) for reason in self.reasons}
        metrics["filter/excluded_frac"] = sum(excluded) / max(len(excluded), 1)
        metrics = reduce_metrics(metrics, sums=lambda key: key != "filter/excluded_frac")  # the step, all ranks
        pl_module.log_dict(metrics, on_step=True, batch_size=len(excluded))

    @override
    def state_dict(self) -> dict:
        return {"total": dict(self._total)}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self._total = Counter(state_dict["total"])
