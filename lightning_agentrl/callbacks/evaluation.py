"""Held-out evaluation: the success rate of the current policy on tasks it never trains on.

Every ``every_n_steps`` optimizer steps (and before the first step, the baseline, and after the
last) the callback plays ``samples_per_task`` episodes of every held-out task through the rollout
service (:meth:`RolloutService.play_episodes`): the run's own engine (torch, vLLM or a server
fleet), agent loop, environment and sandbox service, beside the training episodes. It logs
``eval/success`` (mean final reward), ``eval/solved`` (share with the full reward), ``eval/pass_at_k`` (k = ``samples_per_task``: the share of
tasks whose best sample succeeded) and the share of episodes that submitted, to the logger at the
current step. Training rewards can rise by overfitting the training tasks; SPEC §7 asks for
held-out success. Episodes broken by infrastructure (``sandbox_error``, ``engine_error``) count
in ``eval/infra_errors`` and in no score.

The engine serves the weights of the step: after a step whose weights were not synced (the last
one, or between ``trainer.sync_weights_every``) they are pushed first, as a sync would. Sampling
has its own seed per evaluation, so it does not consume the training sampler's random stream.
Resumable: the history of evaluations is part of the checkpoint.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import replace

import lightning as L
from typing_extensions import override

from lightning_agentrl.tasks import Task
from lightning_agentrl.trajectory import TerminationReason, Trajectory

SOLVED_REWARD = 1.0
"""The full reward: an episode with at least it is solved (all hidden tests passed, the goal reached)."""


def score_episodes(trajectories: list[Trajectory]) -> dict:
    """Success and pass@k of held-out episodes, k being the samples per task.

    ``success`` is the mean final reward; ``solved`` the share of episodes with the full reward (>= 1: all
    hidden tests passed, the goal reached; a partial reward such as a cheap exit's counts in ``success`` but
    not here); ``called_model_frac`` the share that got at least one reply of the policy (an agent may end
    without calling the model); ``pass_at_k`` the mean over tasks of the best reward among the task's samples (with 0/1 rewards and n = k samples, the unbiased pass@k estimator of Chen et
    al. 2021 is exactly this), so ``pass_at_k >= success``. Infrastructure failures are left out of
    both (a task with no other sample is left out of ``pass_at_k``).

    >>> from lightning_agentrl.trajectory import Trajectory as T
    >>> done = TerminationReason.SUBMITTED
    >>> s = score_episodes([T(episode_id="a", task_id="x", group_id=0, reward=1.0, termination=done),
    ...                     T(episode_id="b", task_id="x", group_id=0, reward=0.0, termination=done),
    ...                     T(episode_id="c", task_id="y", group_id=1, reward=0.0, termination=done)])
    >>> s["success"], s["solved"], s["pass_at_k"], s["episodes"]
    (0.3333333333333333, 0.3333333333333333, 0.5, 3)
    """
    scored = [t for t in trajectories if not (t.termination is not None and t.termination.infrastructure)]
    best: dict[str, float] = {}
    for t in scored:
        best[t.task_id] = max(best.get(t.task_id, 0.0), t.reward)
    return {
        "success": sum(t.reward for t in scored) / max(len(scored), 1),
        "solved": sum(t.reward >= SOLVED_REWARD for t in scored) / max(len(scored), 1),
        "pass_at_k": sum(best.values()) / max(len(best), 1),
        "submitted_frac": sum(t.termination is TerminationReason.SUBMITTED for t in scored) / max(len(scored), 1),
        # an agent scoring without the model (env.kind: gateway) shows here: no reply of the policy in its episode
        "called_model_frac": sum(bool(t.segments) for t in scored) / max(len(scored), 1),
        "episodes": len(trajectories),
        "infra_errors": len(trajectories) - len(scored),
        **termination_counts(trajectories),
    }


def termination_counts(trajectories: list[Trajectory]) -> dict[str, dict[str, int]]:
    """How the episodes ended (``terminations``, most frequent first) and what each ``timeout`` interrupted
    (``timeouts``: ``generation``, ``tool`` or ``episode``).

    >>> from lightning_agentrl.trajectory import Trajectory as T
    >>> late = T(episode_id="a", task_id="x", group_id=0, termination="timeout", info={"timeout": "generation"})
    >>> termination_counts([late, late, T(episode_id="b", task_id="x", group_id=0, termination="submitted")])
    {'terminations': {'timeout': 2, 'submitted': 1}, 'timeouts': {'generation': 2}}
    """
    ended = Counter(t.termination.value for t in trajectories if t.termination is not None)
    timeouts = Counter(t.info.get("timeout", "unknown") for t in trajectories if t.termination is TerminationReason.TIMEOUT)
    return {"terminations": dict(ended.most_common()), "timeouts": dict(timeouts.most_common())}


class HeldOutEvaluation(L.Callback):
    def __init__(
        self,
        tasks: list[Task],
        *,
        every_n_steps: int = 10,
        samples_per_task: int = 4,
        temperature: float | None = None,
        seed: int = 0,
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
        self.history: list[dict] = []  # one entry per evaluation, in step order

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
        datamodule = trainer.datamodule
        datamodule.ensure_started()  # the baseline comes before the first batch starts the service
        service, step = datamodule.service, trainer.global_step
        if service.engine_version < step:  # every rank: its own service; a collective under ZeRO-3
            service.sync_weights(pl_module.policy, version=step)
        if not trainer.is_global_zero:
            # Every rank records that step ``step`` was evaluated: under ZeRO each rank resumes from
            # its own callback state, and a rank that would evaluate again alone would wait forever
            # in the collectives above.
            self.history.append({"step": step})
            return {}
        temperature = service.sampling.temperature if self.temperature is None else self.temperature
        sampling = replace(service.sampling, temperature=temperature, seed=self.seed * 1_000_003 + step)
        trajectories = service.play_episodes(
            self.tasks, samples_per_task=self.samples_per_task, sampling=sampling, tag=f"eval{step}"
        )
        entry = {"step": step, **score_episodes(trajectories), "policy_version": service.engine_version,
                 "time": time.time()}  # wall clock when the evaluation finished (success against time)
        self.history.append(entry)
        if trainer.logger is not None:
            keys = ("success", "solved", "pass_at_k", "submitted_frac", "infra_errors")
            trainer.logger.log_metrics({f"eval/{key}": float(entry[key]) for key in keys}, step=step)
        return entry

    # -- resume ------------------------------------------------------------------------------
    @override
    def state_dict(self) -> dict:
        return {"history": [dict(entry) for entry in self.history]}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.history = [dict(entry) for entry in state_dict["history"]]

