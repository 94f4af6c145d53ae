"""Every batch's trajectories on disk, and a readable sample of them in MLflow.

Saves every batch as JSON lines under ``<run.dir>/trajectories/step_*.jsonl`` (an earlier batch of
the same step, one that took no optimizer step or a killed attempt's, is kept aside as
``superseded_step_*``), a decoded sample with the mask highlighted (HTML), and, with an MLflow
logger, both files and the step's credit table as artifacts. With several training processes rank 0
saves every rank's trajectories.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
from typing_extensions import override

from lightning_agentrl.credit import credit_rows
from lightning_agentrl.distributed import gather_to_zero
from lightning_agentrl.render import to_html
from lightning_agentrl.run_layout import RunLayout
from lightning_agentrl.trajectory import RolloutBatch, save_trajectories


class TrajectoryArchive(L.Callback):
    def __init__(self, run_dir: str | Path, tokenizer, num_samples: int = 1) -> None:
        if num_samples < 0:
            raise ValueError(f"num_samples must be >= 0, got {num_samples}")
        self.dir = RunLayout(run_dir).trajectories
        self.tokenizer = tokenizer
        self.num_samples = num_samples

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        every_rank = gather_to_zero(batch.trajectories)
        if trainer.is_global_zero:
            self.save(trainer, [t for share in every_rank for t in share])

    def save(self, trainer: L.Trainer, trajectories) -> None:
        step = trainer.global_step
        path = self.dir / f"step_{step:06d}.jsonl"
        if path.exists():  # an earlier batch at this step (it took no optimizer step, or a killed attempt's)
            earlier = len(list(self.dir.glob(f"superseded_step_{step:06d}_*.jsonl")))
            path.rename(self.dir / f"superseded_step_{step:06d}_{earlier + 1}.jsonl")
        save_trajectories(trajectories, path)
        if self.num_samples == 0:
            return
        sample = self.dir / f"step_{step:06d}_sample.html"
        sample.write_text(to_html(trajectories[: self.num_samples], self.tokenizer), encoding="utf-8")
        logger = trainer.logger
        if logger is not None and hasattr(logger, "run_id") and hasattr(logger.experiment, "log_artifact"):
            logger.experiment.log_artifact(logger.run_id, str(sample), artifact_path="trajectories")
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="trajectories")
            _log_credit_table(logger, trajectories, step)


def _log_credit_table(logger, trajectories, step: int) -> None:
    rows, _ = credit_rows(trajectories)
    if rows:
        # log_dict, not log_table: log_table also appends to the run tag mlflow.loggedArtifacts,
        # which the store cuts at 8000 characters, so after ~150 steps every call fails to parse it.
        table = {"columns": list(rows[0]), "data": [list(row.values()) for row in rows]}
        logger.experiment.log_dict(logger.run_id, table, artifact_file=f"credit/step_{step:06d}.json")
