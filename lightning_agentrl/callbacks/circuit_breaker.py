"""Stop (or wait) when the sandbox service fails, and never train on nothing.

Episodes that end with ``sandbox_error`` are excluded from the loss (SPEC §4), so a dead sandbox
service does not crash a run: it silently trains on nothing, step after step. Two guards:

- :class:`InfraCircuitBreaker` counts, over the newest ``window`` groups of every training process,
  the share of episodes that ended with ``sandbox_error`` (or ``agent_error``: an external agent's code
  failing, ``env.kind: gateway``). Past ``max_error_frac`` (once it has
  seen ``window`` groups), or when every episode of a step failed, it trips: with ``stop`` it writes
  a checkpoint and raises :class:`SandboxOutage` (exit status 3) naming the share and the last
  error; with ``wait`` it polls the service's health with exponential backoff (1 s to 60 s) for up
  to ``wait_s`` and goes on once it answers; a SIGTERM or SIGINT ends the wait at once (the run
  checkpoints and exits with 143 / 130, ``shutdown.py``). A fleet (``sandbox.urls``, or one URL in front
  of several servers) that loses one server keeps the share low (new sandboxes go to the others): only
  the episodes on the dead one count, and the breaker stays closed; with ``wait``, a fleet is back once
  any of its servers answers.
- :class:`EmptyStepGuard`: a batch with no trainable token takes no optimizer step
  (``AgentRLModule.last_step_skipped``); the guard lets the rollout service start the next step's groups
  at the current weights (its staleness gate otherwise opens only on new weights) and stops the
  run with :class:`NothingToTrain` after ``max_empty_steps`` such batches in a row.

The breaker runs before the step (after :class:`TrajectoryArchive`, so the failing batch is on disk).
Every decision is taken on counts gathered from all ranks, so every rank takes the same one.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from pathlib import Path

import lightning as L
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_agentrl.distributed import all_gather
from lightning_agentrl.shutdown import RunStopped
from lightning_agentrl.trajectory import RolloutBatch, TerminationReason

HEALTH_TIMEOUT_S = 5.0
"""Deadline of one health call while waiting for the service (a frozen service must not stall the wait)."""


class SandboxOutage(RunStopped):
    """The sandbox service failed during the run; a checkpoint was written first."""

    exit_status = 3


class NothingToTrain(RunStopped):
    """Batch after batch held no trainable token."""

    exit_status = 3


class SandboxErrorWindow:
    """Sandbox errors per group over the newest ``size`` groups. :meth:`add` takes one step's groups as
    ``(sandbox errors, episodes)`` and says why the breaker trips, or None:

    >>> window = SandboxErrorWindow(size=4, max_error_frac=0.5)
    >>> window.add([(1, 4), (1, 4)]) is None   # one dead server of four: a quarter fails
    True
    >>> window.add([(3, 4), (3, 4)])            # the window is full, 8 of 16 is not more than half
    >>> window.add([(4, 4), (3, 4)])
    '13 of 16 episodes of the last 4 groups ended, more than rollout.max_infra_error_frac=0.5,'
    >>> SandboxErrorWindow(size=8, max_error_frac=1.0).add([(4, 4), (4, 4)])
    'every episode of the step (8) ended'
    """

    def __init__(self, size: int, max_error_frac: float) -> None:
        self.groups: deque[tuple[int, int]] = deque(maxlen=size)
        self.max_error_frac = max_error_frac

    @property
    def share(self) -> float:
        return sum(e for e, _ in self.groups) / max(sum(n for _, n in self.groups), 1)

    def add(self, step_groups: list[tuple[int, int]]) -> str | None:
        self.groups.extend(step_groups)
        if step_groups and all(errors == episodes for errors, episodes in step_groups):
            return f"every episode of the step ({sum(n for _, n in step_groups)}) ended"
        if len(self.groups) == self.groups.maxlen and self.share > self.max_error_frac:
            errors, episodes = sum(e for e, _ in self.groups), sum(n for _, n in self.groups)
            return (f"{errors} of {episodes} episodes of the last {len(self.groups)} groups ended, more than "
                    f"rollout.max_infra_error_frac={self.max_error_frac:g},")
        return None

    def clear(self) -> None:
        self.groups.clear()


class InfraCircuitBreaker(L.Callback):
    def __init__(self, sandbox, checkpoint: Path, *, max_error_frac: float, window: int,
                 on_failure: str = "stop", wait_s: float = 600.0, uses_sandbox: bool = True) -> None:
        if not 0.0 <= max_error_frac <= 1.0:
            raise ValueError(f"rollout.max_infra_error_frac must be in [0, 1], got {max_error_frac}")
        if window < 1:
            raise ValueError(f"rollout.infra_error_window must be >= 1, got {window}")
        if on_failure not in ("stop", "wait"):
            raise ValueError(f"rollout.on_infra_failure must be 'stop' or 'wait', got {on_failure!r}")
        self.sandbox = sandbox
        # what failed, as the messages say it: an environment without the sandbox service has its own backend
        self.what = "the sandbox service" if uses_sandbox else "the environment's infrastructure"
        self.checkpoint = Path(checkpoint)
        self.max_error_frac = max_error_frac
        self.on_failure = on_failure
        self.wait_s = wait_s
        self.window = SandboxErrorWindow(window, max_error_frac)
        self._saved_step: int | None = None
        self.num_trips = 0

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if not isinstance(batch, RolloutBatch):
            return
        every_rank = all_gather((_group_counts(batch), _last_error(batch), _agent_errors(batch)))
        why = self.window.add([group for counts, _, _ in every_rank for group in counts])
        pl_module.log("filter/infra_error_frac_window", self.window.share, on_step=True, batch_size=1)
        if why is None:
            return
        last_error = next((e for _, e, _ in reversed(every_rank) if e), "none recorded")
        # mostly the agents' own failures (env.kind: gateway, a harness missing or crashing): decided on what
        # every rank saw, so all take the same branch below (waiting is a collective)
        agents = sum(n for *_, (n, _) in every_rank) > sum(n for *_, (_, n) in every_rank)
        what = (f"the agent (env.agent / env.agent_command) failed, not {self.what}: {why} with agent_error; last "
                f"error: {last_error}") if agents else f"{self.what} failed: {why} with sandbox_error; last error: {last_error}"
        self.num_trips += 1
        if self.on_failure == "wait" and not agents and self._service_came_back(trainer, what):
            self.window.clear()
            return
        if self._saved_step != trainer.global_step:
            trainer.save_checkpoint(self.checkpoint)
        # an agent's failure is no outage to wait out: no hint to resume once a service is back
        resume = "" if agents else "; continue with --resume last once it is back"
        raise SandboxOutage(f"{what}. Checkpoint: {self.checkpoint} (step {trainer.global_step}){resume}")

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        self._saved_step = trainer.global_step

    def _service_came_back(self, trainer: L.Trainer, what: str) -> bool:
        rank_zero_warn(f"{what}; waiting up to {self.wait_s:g} s for it to answer (rollout.on_infra_failure=wait)")
        return all(all_gather(self._wait_for_health(lambda: trainer.received_sigterm)))

    def _wait_for_health(self, stopping) -> bool:
        """Poll the health call with backoff until it answers (True), ``wait_s`` passes or ``stopping()``
        (a SIGTERM or SIGINT: the run checkpoints and exits at once) (False)."""
        deadline = time.monotonic() + self.wait_s
        delay = 1.0
        while time.monotonic() < deadline and not stopping():
            if _healthy(self.sandbox, timeout_s=min(HEALTH_TIMEOUT_S, self.wait_s)):
                return True
            pause_until = min(time.monotonic() + delay, deadline)
            while time.monotonic() < pause_until and not stopping():
                time.sleep(min(0.2, max(0.0, pause_until - time.monotonic())))
            delay = min(delay * 2, 60.0)
        return False

    @override
    def state_dict(self) -> dict:
        return {"groups": [list(g) for g in self.window.groups], "num_trips": self.num_trips}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.window.clear()
        self.window.groups.extend(tuple(g) for g in state_dict["groups"])
        self.num_trips = state_dict["num_trips"]


class EmptyStepGuard(L.Callback):
    """After a batch that took no optimizer step: open the rollout gate, and stop after too many in a row."""

    def __init__(self, service, *, max_empty_steps: int) -> None:
        if max_empty_steps < 1:
            raise ValueError(f"rollout.max_empty_steps must be >= 1, got {max_empty_steps}")
        self.service = service
        self.max_empty_steps = max_empty_steps
        self.num_empty_in_a_row = 0
        self.num_empty = 0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx: int) -> None:
        if not pl_module.last_step_skipped:
            self.num_empty_in_a_row = 0
            return
        self.num_empty += 1
        self.num_empty_in_a_row += 1
        if self.num_empty_in_a_row >= self.max_empty_steps:
            reasons = Counter(t.termination.value for t in batch.trajectories if t.termination is not None)
            raise NothingToTrain(
                f"{self.num_empty_in_a_row} batches in a row held no trainable token (rollout.max_empty_steps="
                f"{self.max_empty_steps}); every episode was excluded; the last batch ended as {dict(reasons)} "
                f"(see rollout.truncation and filter/* in MLflow)"
            )
        self.service.skip_step()

    @override
    def state_dict(self) -> dict:
        return {"num_empty": self.num_empty, "num_empty_in_a_row": self.num_empty_in_a_row}

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self.num_empty = state_dict["num_empty"]
        self.num_empty_in_a_row = state_dict["num_empty_in_a_row"]


def _group_counts(batch: RolloutBatch) -> list[tuple[int, int]]:
    groups: dict[int, list[int]] = {}
    for t in batch.trajectories:
        counts = groups.setdefault(t.group_id, [0, 0])
        counts[0] += t.termination in (TerminationReason.SANDBOX_ERROR, TerminationReason.AGENT_ERROR)
        counts[1] += 1
    return [(errors, total) for errors, total in groups.values()]


def _agent_errors(batch: RolloutBatch) -> tuple[int, int]:
    """``(agent_error, sandbox_error)`` episodes of the batch."""
    ends = [t.termination for t in batch.trajectories]
    return ends.count(TerminationReason.AGENT_ERROR), ends.count(TerminationReason.SANDBOX_ERROR)


def _last_error(batch: RolloutBatch) -> str | None:
    errors = [t.info.get("agent_error") or t.info["sandbox_error"] for t in batch.trajectories
              if t.info.get("sandbox_error") or t.info.get("agent_error")]
    return errors[-1] if errors else None


def _healthy(sandbox, timeout_s: float) -> bool:
    async def health() -> bool:
        client = sandbox.make_client(timeout_s=timeout_s, max_retries=0, call_timeout_s=None)
        try:
            return (await client.health()).get("status") == "ok"
        finally:
            await client.close()

    try:
        return asyncio.run(health())
    except Exception:  # unreachable, 5xx, refused: not back yet
        return False


__all__ = ["EmptyStepGuard", "InfraCircuitBreaker", "NothingToTrain", "SandboxOutage"]
