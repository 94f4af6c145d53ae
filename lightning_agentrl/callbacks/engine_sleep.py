"""Let training and generation take turns on GPUs they share: the engine sleeps through each step.

With vLLM on the trainer's GPUs (``engine.sleep_while_training``), the engine's share of the GPU
(weights, KV cache) would otherwise sit beside the trainer's activations during the optimizer
step. This callback puts the engine to sleep when a step starts and wakes it when the step ends;
the memory plan (``lightning_agentrl/plan.py``) counts the engine only in the generation phase then.

Order within a step: ``on_train_batch_start`` sleeps (requests in flight finish first), the
forward/backward/optimizer step runs, ``WeightSync`` (registered earlier) pushes the new weights,
which wakes only the engine's weights, and ``on_train_batch_end`` here wakes the KV cache and
reopens the engine to requests.

The engine lives in the rollout service's event loop (another thread); calls are submitted to that
loop and waited for. An engine that has not started yet (no loop) holds no memory: nothing to do.
"""

from __future__ import annotations

import asyncio
import logging

import lightning as L
from typing_extensions import override

log = logging.getLogger(__name__)


class EngineSleep(L.Callback):
    def __init__(self, engine, level: int = 1) -> None:
        if not getattr(engine, "sleep_mode", False):
            raise ValueError(f"{type(engine).__name__} was not built with sleep_mode=True")
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, got {level}")
        self.engine = engine
        self.level = level

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self._run(lambda: self.engine.sleep(self.level))

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        self._run(self.engine.wake_up)

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        # A failed step must not leave the rollout service waiting forever on a sleeping engine, and a
        # failed wake-up (a dead engine) must not replace the error the run is stopping with.
        if self.engine.sleeping:
            try:
                self._run(self.engine.wake_up)
            except Exception as err:
                log.warning("the engine did not wake after the run failed: %s: %s", type(err).__name__, err)

    def _run(self, make_coroutine) -> None:
        loop = self.engine.loop
        if loop is None or loop.is_closed():
            return
        asyncio.run_coroutine_threadsafe(make_coroutine(), loop).result()


def engine_sleep_callbacks(engine) -> list[L.Callback]:
    """``[EngineSleep(engine)]`` for an engine built with ``sleep_mode``, else ``[]``."""
    return [EngineSleep(engine)] if getattr(engine, "sleep_mode", False) else []
