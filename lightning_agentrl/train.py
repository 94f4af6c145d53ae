"""``fit``: the composition root. It wires the settings into a sandbox service, an engine, the rollout
service and a Lightning Trainer, each made by a ``build_*`` function or the module that owns it:

- the run folder's layout: :mod:`~lightning_agentrl.run_layout`; resume policy: :mod:`~lightning_agentrl.resume`
- the engine and local vLLM servers: :mod:`~lightning_agentrl.engines`
- the sandbox service (or its null object): :mod:`~lightning_agentrl.sandbox`
- MLflow: :mod:`~lightning_agentrl.tracking`; the chat template: :func:`~lightning_agentrl.rollout.chat.chat_codec`
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch
from transformers import AutoTokenizer

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
from lightning_agentrl.callbacks.circuit_breaker import EmptyStepGuard, InfraCircuitBreaker
from lightning_agentrl.callbacks.compact_filter import INFRASTRUCTURE, TRUNCATIONS
from lightning_agentrl.callbacks.evaluation import HeldOutEvaluation
from lightning_agentrl.callbacks.gateway_metrics import GatewayMetrics
from lightning_agentrl.callbacks.learning_signal import LearningSignalGuard
from lightning_agentrl.callbacks.stage_timings import StageTimings
from lightning_agentrl.checkpoint_io import AtomicCheckpointIO, StepCheckpoint
from lightning_agentrl.console import RolloutProgressBar, quiet_libraries
from lightning_agentrl.datamodule import RolloutDataModule
from lightning_agentrl.engines import engine_callbacks, make_engine, start_local_servers
from lightning_agentrl.envs.registry import load_env_tasks, settings_env_class
from lightning_agentrl.experiments.forced_truncation import ForcedTruncation
from lightning_agentrl.lora import check_lora
from lightning_agentrl.models.resolve import resolve_model_path
from lightning_agentrl.module import AgentRLModule
from lightning_agentrl.plan import check_memory_plan
from lightning_agentrl.preflight import preflight
from lightning_agentrl.resume import check_run_dir, resume_checkpoint
from lightning_agentrl.rollout.agent_loop import EpisodeBudget
from lightning_agentrl.rollout.chat import chat_codec, native_tools
from lightning_agentrl.rollout.engine import SamplingParams
from lightning_agentrl.rollout.gateway import Gateway
from lightning_agentrl.rollout.service import RolloutPlan, RolloutService
from lightning_agentrl.rollout.sub_agent import build_sub_agent
from lightning_agentrl.rollout.summarize import make_summarizer
from lightning_agentrl.run_layout import RunLayout
from lightning_agentrl.sandbox import make_sandbox
from lightning_agentrl.settings import Settings, SettingsError
from lightning_agentrl.shutdown import StopOnSignal
from lightning_agentrl.strategies import make_strategy
from lightning_agentrl.tracking import attach_logger, finish_run, tracking_uri


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


def fit(settings: Settings, *, callbacks: list | tuple = (), wrap_engine=None) -> FitResult:
    """Train as ``settings`` say. ``callbacks`` are added to the Trainer's; ``wrap_engine``, if given,
    wraps the generation engine (e.g. to record or route requests).

    With several processes every rank runs this function (Lightning's launcher starts the others
    inside ``trainer.fit``; torchrun or SLURM start all of them); rank 0 alone writes the run folder's
    settings, MLflow, trajectories and ``policy/``."""
    layout, resume_from = prepare_run(settings)
    tasks = build_tasks(settings)
    model_path = resolve_model_path(settings)
    check_lora(settings.model, model_path)  # the adapters fit this model's layers, before anything starts
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    codec = chat_codec(settings, tokenizer)
    sandbox = make_sandbox(settings, layout.root)
    servers = start_local_servers(settings, model_path, layout.root)
    try:
        engine = make_engine(settings, model_path, tokenizer, urls=servers.urls if servers else None)
        served = wrap_engine(engine) if wrap_engine is not None else engine  # the rollout service's view
        service = build_rollout_service(settings, served, sandbox, codec, tasks)
        stop = build_stop(settings, layout, service, sandbox)
        # the engine's own callbacks (sleep while training) need the engine itself, not a wrapper
        extra = [*engine_callbacks(engine), *callbacks, stop]  # after WeightSync: wake after the sync
        trainer = build_trainer(settings, layout, service, sandbox, tokenizer, extra=extra)
        logger = attach_logger(settings, layout, trainer)
        run_trainer(settings, model_path, trainer, service, sandbox, stop, resume_from)
    finally:
        if servers is not None:
            servers.stop()
    if trainer.is_global_zero:
        finish_run(settings, layout, trainer, logger)
    return FitResult(
        run_dir=layout.root,
        checkpoint=layout.last_checkpoint,
        policy_dir=layout.policy,
        tracking_uri=tracking_uri(settings, layout) if logger is not None else None,
        mlflow_run_id=logger.run_id if logger is not None else None,
        global_step=trainer.global_step,
        is_global_zero=trainer.is_global_zero,
        **_signal_counts(trainer),
    )


def _signal_counts(trainer) -> dict[str, int]:
    guard = next(c for c in trainer.callbacks if isinstance(c, LearningSignalGuard))
    return {"num_batches": guard.num_batches, "num_without_signal": guard.num_without_signal}


# Lightning warnings that do not apply to this loop, said once here instead of on every run:
# checkpoints are taken after the optimizer step on purpose (the state a resume continues from);
# the rollout stream's length is its step budget, never split across dataloader workers.
_EXPECTED_WARNINGS = (
    r".*Using ModelCheckpoint with manual optimization.*",
    r".*Your `IterableDataset` has `__len__` defined.*",
    r".*You have overridden `transfer_batch_to_device` in `LightningModule` but have passed in a.*",
)


def prepare_run(settings: Settings) -> tuple[RunLayout, Path | None]:
    """Checks that refuse a run before any model loads, then the run folder, threads and seed.
    Returns the run folder's layout and the checkpoint a resume continues from (None for a new run)."""
    quiet_libraries()
    for pattern in _EXPECTED_WARNINGS:
        warnings.filterwarnings("ignore", message=pattern)
    check_memory_plan(settings)  # GPUs only: refuse, before anything loads, a run that cannot fit
    layout = RunLayout(check_run_dir(settings))
    preflight(settings)  # inputs and services, in seconds, before any model loads
    resume_from = resume_checkpoint(layout.checkpoints) if settings.run.resume == "last" else None
    layout.root.mkdir(parents=True, exist_ok=True)
    if settings.trainer.threads:
        torch.set_num_threads(settings.trainer.threads)
    L.seed_everything(settings.run.seed, workers=True, verbose=False)
    return layout, resume_from


def build_tasks(settings: Settings) -> list:
    """The training split's tasks; an empty split is a :class:`SettingsError`."""
    tasks = load_env_tasks(settings, settings.env.split)
    if not tasks:
        raise SettingsError(f"env.tasks: no {settings.env.split} tasks in {settings.env.tasks}")
    return tasks


def build_stop(settings: Settings, layout: RunLayout, service, sandbox) -> StopOnSignal:
    """The signal handler: a checkpoint at the next step boundary, then a clean exit."""
    return StopOnSignal(layout.last_checkpoint, grace_s=settings.trainer.stop_grace_s,
                        wake=service.interrupt, on_hard_exit=sandbox.close)


def run_trainer(settings: Settings, model_path: str, trainer, service, sandbox, stop, resume_from: Path | None) -> None:
    """``trainer.fit`` on the policy and the rollout stream; the service and sandbox stop after it."""
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


def build_rollout_service(settings: Settings, engine, sandbox, codec, tasks) -> RolloutService:
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
    return {"play": Gateway().play} if settings.env.kind == "gateway" else {}


def build_callbacks(settings: Settings, layout: RunLayout, service, sandbox, tokenizer) -> list:
    r = settings.rollout
    filtered = (*INFRASTRUCTURE, *TRUNCATIONS) if r.filters_truncations else INFRASTRUCTURE
    callbacks = [
        sandbox,  # first: its setup starts the node's sandbox server before anything needs it
        StageTimings(),  # early: its on_train_batch_end marks the end of the training step
        TokenCheck(),
        CompactFilter(filtered),
        StalenessWeighting(settings.algorithm.staleness_weighting, settings.algorithm.staleness_rate, r.max_staleness),
        GroupFilter(settings.algorithm.starpo_keep_fraction),
        SegmentBoundaries(),
        RolloutMetrics(service),
        TrajectoryArchive(layout.root, tokenizer, settings.tracking.sample_trajectories),
        *([GatewayMetrics()] if settings.env.kind == "gateway" else []),
        *build_guards(settings, layout, service, sandbox),  # after TrajectoryArchive: a failing batch is saved
        WeightSync(service, settings.trainer.sync_weights_every),
        StepCheckpoint(layout.checkpoints, settings.trainer.checkpoint_every,
                       link_last=not settings.trainer.uses_deepspeed),
        ExportPolicy(layout.policy, tokenizer, adapter_directory=layout.adapter),
        RolloutProgressBar(service),
    ]
    return callbacks + build_evaluation(settings)


def build_evaluation(settings: Settings) -> list:
    """``eval.every_n_steps``: the held-out evaluation; an empty held-out split is a :class:`SettingsError`."""
    if settings.eval.every_n_steps is None:
        return []
    held_out = load_env_tasks(settings, settings.eval.split)
    if not held_out:
        raise SettingsError(f"eval.split: no {settings.eval.split} tasks in {settings.env.tasks}")
    return [HeldOutEvaluation(held_out, every_n_steps=settings.eval.every_n_steps,
                              samples_per_task=settings.eval.samples_per_task, temperature=settings.eval.temperature,
                              seed=settings.run.seed)]


def build_guards(settings: Settings, layout: RunLayout, service, sandbox) -> list:
    """The circuit breaker on sandbox errors and the guards against steps with nothing to train on or
    nothing to learn from."""
    r = settings.rollout
    breaker = InfraCircuitBreaker(
        sandbox, layout.last_checkpoint, max_error_frac=r.max_infra_error_frac,
        window=r.infra_error_window, on_failure=r.on_infra_failure, wait_s=r.infra_wait_s,
        uses_sandbox=sandbox.uses_service,
    )
    return [breaker, EmptyStepGuard(service, max_empty_steps=r.max_empty_steps),
            LearningSignalGuard(max_in_a_row=r.max_steps_without_signal, checkpoint=layout.last_checkpoint)]


def build_trainer(settings: Settings, layout: RunLayout, service, sandbox, tokenizer, *, extra: list) -> L.Trainer:
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
        callbacks=[*build_callbacks(settings, layout, service, sandbox, tokenizer), *extra],
        plugins=None if deepspeed else [AtomicCheckpointIO()],
        default_root_dir=layout.root,
        log_every_n_steps=1,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        enable_model_summary=False,
    )
