"""Held-out evaluation: the success rate of the current policy on tasks it never trains on.

Every ``every_n_steps`` optimizer steps (and before the first step, the baseline, and after the
last) the callback plays ``samples_per_task`` episodes of every held-out task with a copy of the
current weights, through the same agent loop, environment and sandbox service as training (the
rollout service's ``make_client``/``make_env``/``codec``/``budget``), and logs ``eval/success``
(mean final reward) plus the share of episodes that submitted, to the logger at the current step.
Training rewards can rise by overfitting the training tasks; SPEC §7 asks for held-out success.

The evaluation engine is an in-process :class:`TorchEngine` over a private copy of the policy,
so it never disturbs the training engine's policy version or its KV cache. Its sampling has its
own seed per evaluation, so it does not consume the training sampler's random stream.
Resumable: the history of evaluations is part of the checkpoint.
"""

from __future__ import annotations

import asyncio
import copy
import time
from dataclasses import replace

import lightning as L
from typing_extensions import override

from lightning_agentrl.strategies import gather_full_state_dict
from lightning_agentrl.tasks import Task


class HeldOutEvaluation(L.Callback):
    def __init__(
        self,
        tasks: list[Task],
        *,
        every_n_steps: int = 10,
        samples_per_task: int = 4,
        temperature: float | None = None,
        seed: int = 0,
        max_batch_size: int = 64,
    ) -> None:
        if not tasks:
            raise ValueError("HeldOutEvaluation needs at least one task")
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if samples_per_task < 1:
            raise ValueError(f"samples_per_task must be >= 1, got {samples_per_task}")
        if temperature is not None and temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
        self.tasks = list(tasks)
        self.every_n_steps = every_n_steps
        self.samples_per_task = samples_per_task
        self.temperature = temperature  # None: the training temperature
        self.seed = seed
        self.max_batch_size = max_batch_size
        self.history: list[dict] = []  # one entry per evaluation, in step order
        self._model = None

    # -- when --------------------------------------------------------------------------------
    def _evaluated(self, step: int) -> bool:
        return any(entry["step"] == step for entry in self.history)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._evaluated(trainer.global_step):  # the baseline (or the resume point, once)
            self.evaluate(trainer, pl_module)

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step % self.every_n_steps == 0 and not self._evaluated(trainer.global_step):
            self.evaluate(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self._evaluated(trainer.global_step):
            self.evaluate(trainer, pl_module)

    # -- how ---------------------------------------------------------------------------------
    def evaluate(self, trainer: L.Trainer, pl_module: L.LightningModule) -> dict:
        """Play the held-out episodes with the current weights; log and record the result."""
        weights = gather_full_state_dict(pl_module.policy)  # a collective under ZeRO-3: every rank
        if not trainer.is_global_zero:
            return {}
        if self._model is None:
            self._model = _private_copy(pl_module.policy).eval()
        self._model.load_state_dict(weights)
        service = trainer.datamodule.service
        step = trainer.global_step
        rewards, submitted = asyncio.run(self._play(service, step))
        entry = {
            "step": step,
            "success": sum(rewards) / len(rewards),
            "submitted_frac": sum(submitted) / len(submitted),
            "episodes": len(rewards),
            "time": time.time(),  # wall clock when the evaluation finished (success against time)
        }
        self.history.append(entry)
        if trainer.logger is not None:
            trainer.logger.log_metrics(
                {"eval/success": entry["success"], "eval/submitted_frac": entry["submitted_frac"]}, step=step
            )
        return entry

    async def _play(self, service, step: int) -> tuple[list[float], list[bool]]:
        from lightning_agentrl.rollout.agent_loop import run_episode
        from lightning_agentrl.rollout.engine import TorchEngine
        from lightning_agentrl.trajectory import TerminationReason

        tokenizer = service.codec.tokenizer
        engine = TorchEngine(
            self._model,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
            max_batch_size=self.max_batch_size,
            policy_version=step,
        )
        temperature = service.sampling.temperature if self.temperature is None else self.temperature
        sampling = replace(service.sampling, temperature=temperature, seed=self.seed * 1_000_003 + step)
        client = service.make_client()
        try:
            episodes = [
                run_episode(
                    engine=engine,
                    env=service.make_env(client, task),
                    codec=service.codec,
                    sampling=sampling,
                    budget=service.budget,
                    episode_id=f"eval{step}-{task.id}-{i}",
                    task_id=task.id,
                    group_id=index,
                )
                for index, task in enumerate(self.tasks)
                for i in range(self.samples_per_task)
            ]
            trajectories = await asyncio.gather(*episodes)
        finally:
            await client.close()
            await engine.close()
        return (
            [t.reward for t in trajectories],
            [t.termination is TerminationReason.SUBMITTED for t in trajectories],
        )

    # -- resume ------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict:
        return {"history": [dict(entry) for entry in self.history]}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.history = [dict(entry) for entry in state_dict["history"]]


def _private_copy(policy):
    """A model of the policy's architecture that evaluation owns. Under ZeRO-3 the policy's
    parameters are partitioned stubs, so a deep copy would copy stubs: build it from the config
    (full size, on the CPU) instead; the gathered weights are loaded into it afterwards."""
    if not any(hasattr(p, "ds_id") for p in policy.parameters()):
        return copy.deepcopy(policy)
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(policy.config, dtype=policy.dtype)
