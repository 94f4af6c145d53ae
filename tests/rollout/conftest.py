"""Fixtures for the rollout tests: the real sandbox server, a real task, and scripted engines.

A scripted engine stands at the edge of these tests: it returns the token ids of chosen tool calls
(encoded with the real tokenizer) so that each budget and termination path can be forced on purpose.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from lightning_agentrl.envs.base import Environment, StepResult
from lightning_agentrl.rollout.chat import ChatCodec
from lightning_agentrl.rollout.engine import Generation
from lightning_agentrl.tasks import load_tasks

REPO = Path(__file__).resolve().parents[2]
TASK_DIR = REPO / "tasks" / "bugfix" / "binary_search_first"


def call(name: str, **arguments: str) -> str:
    """An action that calls one tool, in the format the environment parses."""
    return f"I act.\n<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


class ScriptedEngine:
    """Plays, for each episode (session id), a fixed list of action texts: one per request, in order.

    ``script`` maps a session id, a group prefix (``"g0"``) or ``"*"`` (any) to its actions; past the end the last action is
    repeated. ``delay_s`` sleeps before answering; ``before_request(session_id, index)`` runs first
    (a test uses it to break the sandbox mid-episode). Every call is recorded in ``calls``.
    """

    def __init__(self, codec: ChatCodec, script: dict[str, list[str]], *, delay_s: float = 0.0,
                 before_request=None, policy_version: int = 0) -> None:
        self.codec = codec
        self.script = script
        self.delay_s = delay_s
        self.before_request = before_request
        self.policy_version = policy_version
        self.calls: list[tuple[str, int, int]] = []  # (session id, request index, policy version)
        self._count: dict[str, int] = {}

    async def generate(self, prompt_ids, sampling, session_id):
        version = self.policy_version  # the weights in force when the request is admitted
        index = self._count.get(session_id, 0)
        self._count[session_id] = index + 1
        if self.before_request is not None:
            await self.before_request(session_id, index)
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        group = session_id.split("-")[0]  # the service names episodes "g<group>-e<index>"
        actions = self.script.get(session_id) or self.script.get(group) or self.script["*"]
        ids = self.codec.encode(actions[min(index, len(actions) - 1)]) + [self.codec.eos_token_id]
        ids = ids[: sampling.max_new_tokens]
        reason = "stop" if ids[-1] == self.codec.eos_token_id else "length"
        self.calls.append((session_id, index, version))
        return Generation(ids, [-0.5] * len(ids), reason, version)

    async def update_weights(self, named_tensors, version):
        self.policy_version = version

    async def close(self):
        pass


class NoClient:
    """Sandbox client stand-in for environments that need no sandbox; the service still makes and closes one."""

    async def close(self) -> None:
        pass


class CountingEnv(Environment):
    """A message-space environment without a sandbox: step n answers a fixed observation of
    ``observation_chars`` characters, and ``done`` with reward 1 at step ``submit_at`` (never if None)."""

    def __init__(self, prompt: str = "Fix utils.py.", *, observation_chars: int = 40, submit_at: int | None = None):
        self.prompt = prompt
        self.observation_chars = observation_chars
        self.submit_at = submit_at
        self.num_steps = 0
        self.closed = False

    async def reset(self) -> list[dict]:
        return [{"role": "system", "content": "You fix bugs."}, {"role": "user", "content": self.prompt}]

    async def step(self, action_text: str) -> StepResult:
        self.num_steps += 1
        if self.submit_at is not None and self.num_steps >= self.submit_at:
            return StepResult("submitted", reward=1.0, done=True, info={"tool": "submit", "submitted": True})
        body = f"step {self.num_steps}: " + "the tests say ok " * self.observation_chars
        return StepResult(body[: self.observation_chars], info={"tool": "run", "error": False})

    @property
    def state_key(self) -> str:
        return f"step-{self.num_steps}"

    @property
    def state_text(self) -> str:
        return f"step {self.num_steps}"

    async def close(self) -> None:
        self.closed = True


@pytest.fixture(scope="session")
def codec(tiny_tokenizer) -> ChatCodec:
    return ChatCodec(tiny_tokenizer)


@pytest.fixture(scope="session")
def task():
    return load_tasks(TASK_DIR)[0]


def counting_service(codec, tasks, engine, plan, *, submit_at: int, max_turns: int = 4, max_new_tokens: int = 64,
                     **extra):
    """A rollout service on :class:`CountingEnv` (no sandbox) with a seeded sampler; ``extra`` goes to
    :class:`~lightning_agentrl.rollout.service.RolloutService` as it is (e.g. ``episode_budget``)."""
    from lightning_agentrl.rollout.agent_loop import EpisodeBudget
    from lightning_agentrl.rollout.engine import SamplingParams
    from lightning_agentrl.rollout.service import RolloutService

    return RolloutService(
        engine=engine, make_client=NoClient, make_env=lambda client, task: CountingEnv(submit_at=submit_at),
        codec=codec, tasks=tasks, sampling=SamplingParams(max_new_tokens=max_new_tokens, seed=0),
        budget=EpisodeBudget(max_turns=max_turns), plan=plan, **extra,
    )
