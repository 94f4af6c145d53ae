"""The run's record in MLflow: the logger, the resolved settings as params and artifact, the plots.

Rank 0 alone opens the store. The store is ``tracking.uri``, or a SQLite file in the run folder
(``mlflow.db``, artifacts in ``mlartifacts/``); a resume continues the MLflow run it started
(``mlflow_run_id.txt``). MLflow itself is imported only where it is used.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import time
from pathlib import Path

import yaml
from lightning.pytorch.loggers import MLFlowLogger

from lightning_agentrl.run_layout import RunLayout
from lightning_agentrl.settings import Settings, SettingsError, flatten

log = logging.getLogger(__name__)


def tracking_uri(settings: Settings, layout: RunLayout) -> str:
    return settings.tracking.uri or f"sqlite:///{layout.mlflow_db.resolve()}"


def build_logger(settings: Settings, layout: RunLayout) -> MLFlowLogger | None:
    """Lightning's MLFlowLogger, continuing the run's MLflow run on a resume. Nothing touches the
    store here: the run is created on rank 0 alone, by :func:`record_settings`."""
    if not settings.tracking.enabled:
        return None
    # MLflow's defaults (7 retries, 120 s per request) turn a tracking server that dies mid-run into
    # a hang of tens of minutes; bounded, its failure surfaces within about a minute.
    for name, value in (("MLFLOW_HTTP_REQUEST_TIMEOUT", "20"), ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")):
        os.environ.setdefault(name, value)
    id_file = layout.mlflow_run_id
    run_id = id_file.read_text().strip() if settings.run.resume == "last" and id_file.exists() else None
    return MLFlowLogger(
        experiment_name=settings.tracking.experiment,
        run_name=layout.root.name,
        tracking_uri=tracking_uri(settings, layout),
        artifact_location=layout.mlflow_artifacts.resolve().as_uri(),
        run_id=run_id,
    )


def attach_logger(settings: Settings, layout: RunLayout, trainer) -> MLFlowLogger | None:
    """Rank 0 alone opens the MLflow store (even constructing the logger touches it): the Trainer
    knows the rank only once it exists, so the logger joins it afterwards. Returns the logger
    (None on other ranks or with tracking off)."""
    if not trainer.is_global_zero:
        return None
    logger = build_logger(settings, layout)
    trainer.logger = logger
    record_settings(settings, layout, logger)
    return logger


def record_settings(settings: Settings, layout: RunLayout, logger) -> None:
    """Rank 0: the resolved settings as a file (a resume keeps the original ``settings.yaml`` and
    records its own beside it), as MLflow params and as an artifact."""
    settings_file = layout.settings_file
    if settings.run.resume == "last":
        settings_file = layout.resume_settings_file(time.strftime("%Y%m%d-%H%M%S"))
    settings_file.write_text(yaml.safe_dump(_with_absolute_paths(settings), sort_keys=False))
    if logger is None:
        return
    from mlflow.exceptions import MlflowException

    try:
        _record_in_mlflow(settings, layout, logger, settings_file)
    except MlflowException as err:  # a server that passed the start-up check and failed since
        why = " ".join(err.message.split())[:500]
        raise SettingsError(f"tracking.uri: recording the run in {tracking_uri(settings, layout)} failed: {why}") from None


def _record_in_mlflow(settings: Settings, layout: RunLayout, logger, settings_file) -> None:
    layout.mlflow_run_id.write_text(logger.run_id)
    params = flatten(settings)
    logged = logger.experiment.get_run(logger.run_id).data.params
    # MLflow params are write-once: a resumed run logs only new keys; the settings it resumed
    # with (e.g. run.resume=last, a longer max_steps) are kept as an artifact of their own.
    logger.log_hyperparams({k: v for k, v in params.items() if k not in logged})
    artifact_path = "resumed" if logged else None
    logger.experiment.log_artifact(logger.run_id, str(settings_file), artifact_path=artifact_path)


def _with_absolute_paths(settings: Settings) -> dict:
    """The settings as data, with local paths made absolute, so that ``--resume last`` (which takes
    this file as its base) works from any folder."""
    data = settings.model_dump(mode="json")
    data["sandbox"].pop("token", None)  # a secret: never written down (a resume takes it from the command or environment)
    data["run"]["dir"] = str(Path(settings.run.dir).resolve())
    data["model"]["cache_dir"] = str(Path(settings.model.cache_dir).resolve())
    for section, key in (("env", "tasks"), ("model", "path")):
        if Path(data[section][key]).exists():
            data[section][key] = str(Path(data[section][key]).resolve())
    return data


def finish_run(settings: Settings, layout: RunLayout, trainer, logger) -> None:
    """Rank 0, after training: plots to MLflow and the run's summary."""
    if logger is not None and importlib.util.find_spec("matplotlib") is not None:  # the `plots` extra
        from lightning_agentrl.plots import plot_run

        for path in plot_run(tracking_uri(settings, layout), logger.run_id, layout.plots):
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="plots")
    elif logger is not None:
        log.info("no plots: matplotlib is not installed (pip install 'lightning-agentrl[plots]')")
    summary = {
        "global_step": trainer.global_step,
        "checkpoint": str(layout.last_checkpoint),
        "policy": str(layout.policy),
    }
    layout.summary.write_text(json.dumps(summary, indent=2))


__all__ = ["attach_logger", "build_logger", "finish_run", "record_settings", "tracking_uri"]
