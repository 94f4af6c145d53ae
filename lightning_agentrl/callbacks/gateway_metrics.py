"""What the gateway's episodes cost and how often their history could not be continued (``env.kind: gateway``).

``gateway/prefix_breaks``: calls whose rendered prompt did not begin with the episode's previous prompt and
sampled ids (each opened a new segment: the agent edited its history, or its framework re-serialized it);
a high share means the agent's context is re-encoded every call, and prefill is paid again each time.
``gateway/calls``: calls to the model; ``gateway/episodes_without_calls``: episodes whose agent never called
it (nothing to train). Summed over the batch's episodes and over ranks.
"""

from __future__ import annotations

import lightning as L
from typing_extensions import override

from lightning_agentrl.distributed import reduce_metrics
from lightning_agentrl.trajectory import RolloutBatch


class GatewayMetrics(L.Callback):
    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        infos = [t.info for t in batch.trajectories]
        metrics = {
            "gateway/prefix_breaks": float(sum(info.get("prefix_breaks", 0) for info in infos)),
            "gateway/calls": float(sum(info.get("gateway_calls", 0) for info in infos)),
            "gateway/episodes_without_calls": float(sum(info.get("gateway_calls", 0) == 0 for info in infos)),
        }
        metrics = reduce_metrics(metrics, sums=lambda key: True)
        pl_module.log_dict(metrics, on_step=True, batch_size=len(infos))
