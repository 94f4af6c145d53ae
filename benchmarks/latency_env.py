"""A benchmark environment whose every step waits on the real sandbox service for a drawn time.

``env.kind: benchmarks.latency_env:LatencyEnv`` (importable from the repository root). Each episode
creates a sandbox on the run's sandbox service (the one ``fit`` starts, or ``sandbox.url``); each
action runs ``sleep <seconds>`` in it, ``seconds`` drawn from a lognormal distribution (median
``latency_median_s``, log-space std ``latency_sigma``: heavy-tailed), seeded by the task id and how
many episodes of that task this process has built, so every run draws the same latencies in the
same order. The episode ends after ``turns`` actions with reward 1 when the last action contains
the task's digit, else 0; the observation after an action is "ok". With ``latency_median_s: 0``
no command runs (and no sandbox is created): the scaling benchmark's pure-compute episodes.

Tasks are a JSONL file, one ``{"id", "digit", "turns", "latency_median_s", "latency_sigma"}`` a line
(:func:`write_tasks`); every task is in every split.
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from lightning_agentrl.envs.base import EnvInfraError, Environment, StepResult, ToolTimeout


@dataclass(frozen=True)
class LatencyTask:
    id: str
    digit: str
    turns: int = 1
    latency_median_s: float = 0.0
    latency_sigma: float = 1.0


def write_tasks(path: Path, count: int, *, turns: int, latency_median_s: float, latency_sigma: float,
                seed: int = 0) -> Path:
    """``count`` tasks with random digits and the given shape."""
    draw = random.Random(seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({
        "id": f"t{i}", "digit": str(draw.randrange(10)), "turns": turns, "latency_median_s": latency_median_s,
        "latency_sigma": latency_sigma}) + "\n" for i in range(count)))
    return path


def latencies(task: LatencyTask, episode: int) -> list[float]:
    """The sleep of each step of the ``episode``-th episode of ``task`` (lognormal, seeded)."""
    if task.latency_median_s <= 0:
        return [0.0] * task.turns
    draw = random.Random(f"{task.id}:{episode}")
    mu = math.log(task.latency_median_s)
    return [draw.lognormvariate(mu, task.latency_sigma) for _ in range(task.turns)]


_episodes_built: dict[str, itertools.count] = defaultdict(itertools.count)


class LatencyEnv(Environment):
    uses_sandbox = True  # each step is a real round trip to the sandbox service

    @classmethod
    def load_tasks(cls, path, *, split):
        lines = Path(path).read_text().splitlines()
        tasks = [LatencyTask(**json.loads(line)) for line in lines if line.strip()]
        if not tasks:
            raise ValueError(f"{path}: no tasks")
        return tasks

    @classmethod
    def from_settings(cls, task, *, client, settings, native_tools):
        return cls(task, client)

    def __init__(self, task: LatencyTask, client=None) -> None:
        self.task, self.client = task, client
        self.sleeps = latencies(task, next(_episodes_built[task.id]))
        self.turn = 0
        self.sandbox_id: str | None = None

    async def reset(self) -> list[dict]:
        if self.task.latency_median_s > 0:
            self.sandbox_id = await self.client.create({})
        return [{"role": "user", "content": f"Repeat the digit {self.task.digit}:"}]

    async def step(self, action_text: str) -> StepResult:
        seconds = self.sleeps[self.turn]
        self.turn += 1
        if self.sandbox_id is not None:
            result = await self.client.exec(self.sandbox_id, ["sleep", f"{seconds:.3f}"], timeout_s=seconds + 30)
            if result.exit_code != 0:
                raise EnvInfraError(f"sleep exited {result.exit_code}: {result.stderr[-200:]}")
        done = self.turn >= self.task.turns
        reward = float(done and self.task.digit in action_text)
        return StepResult("" if done else "ok", reward=reward, done=done, info={"tool": "sleep"})

    async def close(self) -> None:
        if self.sandbox_id is not None:
            sandbox_id, self.sandbox_id = self.sandbox_id, None
            await self.client.delete(sandbox_id)

    def classify_error(self, err: Exception) -> EnvInfraError | ToolTimeout | None:
        from sandbox_client import CommandTimeout, SandboxInfraError

        if isinstance(err, CommandTimeout):
            return ToolTimeout(str(err))
        if isinstance(err, SandboxInfraError):
            return EnvInfraError(str(err))
        return None

    @property
    def state_text(self) -> str:
        return f"digit {self.task.digit}, turn {self.turn}"
