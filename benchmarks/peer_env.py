"""The peer benchmark's own environment: TRL's digit workload, as this project's environment API takes it.

``env.kind: benchmarks.peer_env:RepeatDigitEnv`` (importable from the repository root). One user
message "Repeat the digit N:", no system prompt and no tools, one action per episode: the episode
ends after the first action with reward 1 when the action's text contains N (TRL side:
``float(digit in completion)``), else 0. Ending on the action appends no observation, so the
project trains on the prompt and the completion only, as TRL does.

Tasks are a JSONL file, one ``{"id", "digit"}`` a line (``benchmarks/peer_trl.py`` writes it from
the digits the TRL side drew); every task is in every split.

>>> import asyncio
>>> env = RepeatDigitEnv(DigitTask("t0", "7"))
>>> asyncio.run(env.reset())
[{'role': 'user', 'content': 'Repeat the digit 7:'}]
>>> asyncio.run(env.step("7 7 7"))
StepResult(observation='', reward=1.0, done=True, info={'tool': None, 'submitted': True})
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from lightning_agentrl.envs.base import Environment, StepResult


@dataclass(frozen=True)
class DigitTask:
    id: str
    digit: str


def prompt_text(digit: str) -> str:
    """The one user message of both sides."""
    return f"Repeat the digit {digit}:"


def write_tasks(path: Path, digits: list[str]) -> Path:
    """A tasks file with one task per digit, in order (task ``d<index>``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": f"d{i}", "digit": d}) + "\n" for i, d in enumerate(digits)))
    return path


class RepeatDigitEnv(Environment):
    @classmethod
    def load_tasks(cls, path, *, split):
        lines = Path(path).read_text().splitlines()
        tasks = [DigitTask(**json.loads(line)) for line in lines if line.strip()]
        if not tasks:
            raise ValueError(f"{path}: no tasks")
        return tasks

    def __init__(self, task: DigitTask) -> None:
        self.task = task

    async def reset(self) -> list[dict]:
        return [{"role": "user", "content": prompt_text(self.task.digit)}]

    async def step(self, action_text: str) -> StepResult:
        reward = float(self.task.digit in action_text)
        return StepResult("", reward=reward, done=True, info={"tool": None, "submitted": True})

    @property
    def state_text(self) -> str:
        return prompt_text(self.task.digit)
