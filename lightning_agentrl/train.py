"""``fit``: wire settings into a sandbox service, an engine, the rollout service and a Trainer.

Everything a run writes goes under ``run.dir``::

    <run.dir>/settings.yaml          the resolved settings (also an MLflow artifact)
    <run.dir>/checkpoints/last.ckpt  Lightning checkpoint (optimizer, policy version, buffer, callbacks)
    <run.dir>/policy/                the final policy, save_pretrained format
    <run.dir>/mlflow.db              MLflow store (unless tracking.uri is set); artifacts in mlartifacts/
    <run.dir>/trajectories/          every batch as JSON lines, plus a decoded sample per step
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

from lightning_agentrl.settings import Settings, SettingsError, flatten


@dataclass
class FitResult:
    run_dir: Path
    checkpoint: Path
    policy_dir: Path
    tracking_uri: str | None
    mlflow_run_id: str | None
    global_step: int


def resolve_model_path(settings: Settings) -> str:
    """``tiny`` builds (once) the local tiny model; anything else goes to ``from_pretrained``."""
    if settings.model.path != "tiny":
        return settings.model.path
    from lightning_agentrl.models.tiny import TinyModelConfig, build_tiny_model

    config = TinyModelConfig(hidden_size=settings.model.tiny_hidden_size, num_hidden_layers=settings.model.tiny_num_layers)
    return str(build_tiny_model(settings.model.cache_dir, config))


def make_engine(settings: Settings, model_path: str, tokenizer):
    e = settings.engine
    if e.kind == "vllm":
        from lightning_agentrl.plan import on_gpu
        from lightning_agentrl.rollout.vllm_engine import VLLMEngine

        gpu = on_gpu(settings)  # the KV cache: a byte size on CPU, a share of the GPU on GPUs
        return VLLMEngine(
            model_path,
            num_replicas=e.num_replicas,
            dtype=settings.model.dtype,
            max_model_len=settings.env.max_context_tokens + 1,
            kv_cache_memory_bytes=None if gpu else e.vllm_kv_cache_bytes,
            gpu_memory_utilization=e.gpu_memory_utilization if gpu else None,
            sleep_mode=gpu and e.sleep_while_training,
            seed=settings.run.seed,
        )
    import torch
    from transformers import AutoModelForCausalLM

    from lightning_agentrl.rollout.engine import TorchEngine

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, settings.model.dtype))
    return TorchEngine(model, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id, max_batch_size=e.max_batch_size)


def _mlflow_logger(settings: Settings, run_dir: Path):
    if not settings.tracking.enabled:
        return None
    from lightning.pytorch.loggers import MLFlowLogger

    uri = settings.tracking.uri or f"sqlite:///{(run_dir / 'mlflow.db').resolve()}"
    id_file = run_dir / "mlflow_run_id.txt"
    run_id = id_file.read_text().strip() if settings.run.resume == "last" and id_file.exists() else None
    logger = MLFlowLogger(
        experiment_name=settings.tracking.experiment,
        run_name=run_dir.name,
        tracking_uri=uri,
        artifact_location=(run_dir / "mlartifacts").resolve().as_uri(),
        run_id=run_id,
    )
    id_file.write_text(logger.run_id)
    return logger


# Lightning warnings that do not apply to this loop, said once here instead of on every run:
# checkpoints are taken after the optimizer step on purpose (the state a resume continues from);
# the rollout stream's length is its step budget, never split across dataloader workers.
_EXPECTED_WARNINGS = (
    r".*Using ModelCheckpoint with manual optimization.*",
    r".*Your `IterableDataset` has `__len__` defined.*",
    r".*You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a.*",
)


def fit(settings: Settings, *, callbacks: list | tuple = (), wrap_engine=None) -> FitResult:
    """Train as ``settings`` say. ``callbacks`` are added to the Trainer's; ``wrap_engine``, if given,
    wraps the generation engine (e.g. to record or route requests)."""
    import warnings

    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint
    from transformers import AutoTokenizer

    from lightning_agentrl.callbacks import (
        CompactFilter,
        GroupFilter,
        RolloutMetrics,
        SegmentBoundaries,
        StalenessWeighting,
        TokenCheck,
        WeightSync,
    )
    from lightning_agentrl.callbacks.compact_filter import TRUNCATIONS
    from lightning_agentrl.callbacks.engine_sleep import engine_sleep_callbacks
    from lightning_agentrl.checkpoint_io import AtomicCheckpointIO
    from lightning_agentrl.datamodule import RolloutDataModule
    from lightning_agentrl.envs.coding import CodingEnv
    from lightning_agentrl.module import AgentRLModule
    from lightning_agentrl.plan import check_memory_plan
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.rollout.engine import SamplingParams
    from lightning_agentrl.rollout.service import RolloutPlan, RolloutService
    from lightning_agentrl.rollout.summarize import make_summarizer
    from lightning_agentrl.strategies import make_strategy
    from lightning_agentrl.tasks import load_tasks

    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    check_memory_plan(settings)  # GPUs only: refuse, before anything loads, a run that cannot fit
    run_dir = Path(settings.run.dir)
    checkpoint_dir = run_dir / "checkpoints"
    last = checkpoint_dir / "last.ckpt"
    if settings.run.resume == "last" and not last.exists():
        raise SettingsError(f"run.resume=last but there is no checkpoint at {last}")
    if settings.run.resume == "never" and last.exists():
        raise SettingsError(
            f"{run_dir} already holds a run ({last}); pass --resume last to continue it, or choose another run.dir"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    # A resume keeps the original settings.yaml and records what it resumed with beside it.
    settings_file = run_dir / "settings.yaml"
    if settings.run.resume == "last":
        settings_file = run_dir / f"settings.resume-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    settings_file.write_text(yaml.safe_dump(settings.model_dump(mode="json"), sort_keys=False))
    if settings.trainer.threads:
        torch.set_num_threads(settings.trainer.threads)
    L.seed_everything(settings.run.seed, workers=True, verbose=False)

    tasks = load_tasks(settings.env.tasks, split=None if settings.env.split == "all" else settings.env.split)
    if not tasks:
        raise SettingsError(f"env.tasks: no {settings.env.split} tasks in {settings.env.tasks}")
    model_path = resolve_model_path(settings)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    codec = ChatCodec(tokenizer)

    with contextlib.ExitStack() as stack:
        url, token = settings.sandbox.url, settings.sandbox.token
        if url is None:
            from sandbox_server.launch import start_local_server

            server = stack.enter_context(start_local_server(log_file=run_dir / "sandbox_server.log"))
            url, token = server.url, server.token

        def make_client():
            from sandbox_client import SandboxClient

            return SandboxClient(
                url, token or "", timeout_s=settings.sandbox.request_timeout_s, max_retries=settings.sandbox.max_retries
            )

        def make_env(client, task):
            return CodingEnv(
                client,
                task,
                tool_timeout_s=settings.env.tool_timeout_s,
                max_observation_chars=settings.env.max_observation_chars,
                system_prompt=settings.env.system_prompt,
            )

        e, r = settings.engine, settings.rollout
        engine = make_engine(settings, model_path, tokenizer)
        service = RolloutService(
            engine=wrap_engine(engine) if wrap_engine is not None else engine,
            make_client=make_client,
            make_env=make_env,
            codec=codec,
            tasks=tasks,
            sampling=SamplingParams(
                max_new_tokens=e.max_new_tokens, temperature=e.temperature, top_p=e.top_p, seed=settings.run.seed
            ),
            budget=EpisodeBudget(
                max_turns=settings.env.max_turns,
                max_context_tokens=settings.env.max_context_tokens,
                generation_timeout_s=settings.env.generation_timeout_s,
                episode_timeout_s=settings.env.episode_timeout_s,
                max_tool_errors=settings.env.max_tool_errors,
            ),
            plan=RolloutPlan(
                r.group_size, r.groups_per_step, r.max_in_flight, r.max_staleness, settings.run.seed,
                partial_rollout_s=r.partial_rollout_s,
                forced_truncation_rate=r.forced_truncation_rate,
                forced_truncation_turns=r.forced_truncation_turns,
            ),
            summarizer=make_summarizer(
                settings.env.summarizer, codec, max_summary_tokens=settings.env.summary_max_tokens
            ),
        )
        stack.callback(service.stop)

        filtered = ("sandbox_error", *(t.value for t in TRUNCATIONS)) if r.truncation == "filter" else ("sandbox_error",)
        logger = _mlflow_logger(settings, run_dir)
        if logger is not None:
            params = flatten(settings)
            logged = logger.experiment.get_run(logger.run_id).data.params
            # MLflow params are write-once: a resumed run logs only new keys; the settings it resumed
            # with (e.g. run.resume=last, a longer max_steps) are kept as an artifact of their own.
            logger.log_hyperparams({k: v for k, v in params.items() if k not in logged})
            artifact_path = "resumed" if logged else None
            logger.experiment.log_artifact(logger.run_id, str(settings_file), artifact_path=artifact_path)
        checkpointing = ModelCheckpoint(
            dirpath=checkpoint_dir,
            filename="step_{step}",
            every_n_train_steps=settings.trainer.checkpoint_every,
            save_last=True,
            save_top_k=1,
        )
        extra = list(callbacks) + engine_sleep_callbacks(engine)  # after WeightSync: wake after the sync
        if settings.eval.every_n_steps is not None:
            from lightning_agentrl.callbacks.evaluation import HeldOutEvaluation

            split = None if settings.eval.split == "all" else settings.eval.split
            held_out = load_tasks(settings.env.tasks, split=split)
            if not held_out:
                raise SettingsError(f"eval.split: no {settings.eval.split} tasks in {settings.env.tasks}")
            extra.append(
                HeldOutEvaluation(
                    held_out,
                    every_n_steps=settings.eval.every_n_steps,
                    samples_per_task=settings.eval.samples_per_task,
                    temperature=settings.eval.temperature,
                    seed=settings.run.seed,
                )
            )
        trainer = L.Trainer(
            max_steps=settings.trainer.max_steps,
            accelerator=settings.trainer.accelerator,
            devices=settings.trainer.devices,
            strategy=make_strategy(
                settings.trainer.strategy,
                offload_optimizer=settings.trainer.offload_optimizer,
                accelerator=settings.trainer.accelerator,
                gradient_clipping=settings.trainer.grad_clip if settings.trainer.strategy.startswith("deepspeed") else None,
            ),
            precision=settings.trainer.precision,
            logger=logger if logger is not None else False,
            callbacks=[
                TokenCheck(),
                CompactFilter(filtered),
                StalenessWeighting(
                    settings.algorithm.staleness_weighting, settings.algorithm.staleness_rate, r.max_staleness
                ),
                GroupFilter(settings.algorithm.starpo_keep_fraction),
                SegmentBoundaries(),
                RolloutMetrics(run_dir, tokenizer, service, settings.tracking.sample_trajectories),
                WeightSync(service, settings.trainer.sync_weights_every),
                checkpointing,
                *extra,
            ],
            plugins=[AtomicCheckpointIO()] if not settings.trainer.strategy.startswith("deepspeed") else None,
            default_root_dir=run_dir,
            log_every_n_steps=1,
            num_sanity_val_steps=0,
            limit_val_batches=0,
            enable_model_summary=False,
        )
        module = AgentRLModule(settings, model_path)
        datamodule = RolloutDataModule(service)
        trainer.fit(module, datamodule=datamodule, ckpt_path=str(last) if settings.run.resume == "last" else None)
        service.stop()

        policy_dir = run_dir / "policy"
        if trainer.is_global_zero and logger is not None:
            from lightning_agentrl.plots import plot_run

            for path in plot_run(logger._tracking_uri, logger.run_id, run_dir / "plots"):
                logger.experiment.log_artifact(logger.run_id, str(path), artifact_path="plots")
        if trainer.is_global_zero:
            module.policy.save_pretrained(policy_dir)
            tokenizer.save_pretrained(policy_dir)
            summary = {"global_step": trainer.global_step, "checkpoint": str(last), "policy": str(policy_dir)}
            (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        return FitResult(
            run_dir=run_dir,
            checkpoint=last,
            policy_dir=policy_dir,
            tracking_uri=logger._tracking_uri if logger is not None else None,
            mlflow_run_id=logger.run_id if logger is not None else None,
            global_step=trainer.global_step,
        )


