"""Where a run keeps each of its outputs under ``run.dir``: the one place that spells those names.

>>> layout = RunLayout("runs/smoke")
>>> str(layout.last_checkpoint), str(layout.policy)
('runs/smoke/checkpoints/last.ckpt', 'runs/smoke/policy')

Everything ``fit`` and ``sft`` write, and what ``evaluate``, ``inspect`` and ``--resume last`` read back::

    settings.yaml          the resolved settings (a resume adds settings.resume-<time>.yaml beside it)
    checkpoints/last.ckpt  the newest Lightning checkpoint (a link to step_step=N.ckpt, or a DeepSpeed folder)
    policy/                the final policy, save_pretrained format (adapter/: the LoRA adapters alone)
    mlflow.db              MLflow store (unless tracking.uri is set); artifacts in mlartifacts/
    mlflow_run_id.txt      the MLflow run a resume continues
    trajectories/          every batch as JSON lines, plus a decoded sample per step
    plots/, summary.json   written after training
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

LAST_CHECKPOINT = "last.ckpt"
"""The name of the newest checkpoint in a checkpoint folder (a file, a link or a DeepSpeed folder)."""


@dataclass(frozen=True)
class RunLayout:
    """The paths of a run folder; relative when ``root`` is."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))  # a str is welcome

    @property
    def settings_file(self) -> Path:
        return self.root / "settings.yaml"

    def resume_settings_file(self, stamp: str) -> Path:
        """The settings a resume at ``stamp`` (``%Y%m%d-%H%M%S``) ran with."""
        return self.root / f"settings.resume-{stamp}.yaml"

    def resume_settings_files(self) -> list[Path]:
        """Every resume's settings file, oldest first."""
        return sorted(self.root.glob("settings.resume-*.yaml"))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / LAST_CHECKPOINT

    @property
    def policy(self) -> Path:
        return self.root / "policy"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def trajectories(self) -> Path:
        return self.root / "trajectories"

    @property
    def mlflow_db(self) -> Path:
        return self.root / "mlflow.db"

    @property
    def mlflow_artifacts(self) -> Path:
        return self.root / "mlartifacts"

    @property
    def mlflow_run_id(self) -> Path:
        return self.root / "mlflow_run_id.txt"

    @property
    def plots(self) -> Path:
        return self.root / "plots"

    @property
    def summary(self) -> Path:
        return self.root / "summary.json"

    @property
    def demonstrations(self) -> Path:
        return self.root / "demonstrations.jsonl"

    @property
    def vllm_servers(self) -> Path:
        """Logs of the vLLM servers a run starts itself."""
        return self.root / "vllm_servers"

    @property
    def engine_weights(self) -> Path:
        """Where the policy's weights are written for vLLM servers to load (absolute: servers run elsewhere)."""
        return self.root.resolve() / "engine_weights"

    @property
    def engine_adapters(self) -> Path:
        """Where an in-process vLLM engine's LoRA adapters are written, one per policy version."""
        return self.root.resolve() / "engine_adapters"


__all__ = ["LAST_CHECKPOINT", "RunLayout"]
