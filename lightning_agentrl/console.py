"""What a run prints while it works: a progress bar that speaks in rollout steps, and no lines a user cannot act on.

Lightning's progress bar counts epochs and batches per second (``Epoch 0/-2 ... 0.00it/s``: a run has no
epochs, and a step takes seconds to minutes). :class:`RolloutProgressBar` keeps Lightning's rich bar and
shows ``step k/N``, the episodes finished and in flight, the tokens per second of the last step and its mean
reward. :func:`quiet_libraries` silences what every run printed without a use: Lightning's litlogger tip,
a ``LeafSpec`` deprecation inside Lightning, DeepSpeed's "Setting accelerator to CPU" on stdout, the
progress bars of transformers' weight loading and saving and MLflow's database set-up lines.
:func:`quiet_vllm` does the same for the in-process vLLM engine's info lines and warnings (its errors stay;
``VLLM_LOGGING_LEVEL=INFO`` brings the rest back); servers the run starts keep theirs, in their log files.
"""

from __future__ import annotations

import logging
import os
import time
import warnings

import lightning as L
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override


class _DropLitLoggerTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


def quiet_libraries() -> None:
    """Silence library output no user can act on (idempotent); call before the libraries are imported."""
    import torch

    if not torch.cuda.is_available():  # on GPUs DeepSpeed must detect CUDA itself
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)` is deprecated.*")
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.WARNING)  # "Creating initial MLflow database tables"
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _DropLitLoggerTip) for f in rank_zero.filters):
        rank_zero.addFilter(_DropLitLoggerTip())
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()


def quiet_vllm() -> None:
    """The in-process vLLM engine (and its engine-core and worker processes, which read the environment) logs
    errors only, unless ``VLLM_LOGGING_LEVEL`` says otherwise: its info lines and warnings (about 50 lines at
    start-up, on CPU mostly about kernels that are not there) say nothing a user can act on."""
    import sys

    level = os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    if "vllm" in sys.modules:  # imported already (a check): its logger was set up with the old level
        logging.getLogger("vllm").setLevel(level)


class RolloutProgressBar(RichProgressBar):
    """``step k/N``, episodes finished and in flight (``service``'s counters), tokens per second of the last
    step (its tokens over the time since the previous step ended, this process's share) and its mean reward."""

    def __init__(self, service) -> None:
        super().__init__()
        self.service = service
        self._last_end: float | None = None
        self._tokens_per_s: float | None = None

    @override
    def configure_columns(self, trainer: L.Trainer) -> list:
        return super().configure_columns(trainer)[:-1]  # no batches per second: a step takes seconds to minutes

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._last_end = time.perf_counter()

    @override
    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        if self.progress is not None and self.train_progress_bar_id is not None:
            self.progress.update(self.train_progress_bar_id, description="step")  # not "Epoch 0/-2"

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        now = time.perf_counter()
        tokens = sum(t.num_tokens for t in getattr(batch, "trajectories", []))
        if self._last_end is not None and now > self._last_end:
            self._tokens_per_s = tokens / (now - self._last_end)
        self._last_end = now
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def get_metrics(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        items: dict = {"episodes": f"{self.service.num_episodes_finished} done, {self.service.num_in_flight} in flight"}
        if self._tokens_per_s is not None:
            items["tokens/s"] = f"{self._tokens_per_s:.0f}"
        reward = trainer.progress_bar_metrics.get("reward")
        if reward is not None:
            items["reward"] = f"{float(reward):.3f}"
        return items


__all__ = ["RolloutProgressBar", "quiet_libraries", "quiet_vllm"]
