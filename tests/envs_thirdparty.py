"""A third-party environment, as a user would write it in their own package: nothing in
``lightning_agentrl`` knows it; settings name it ``env.kind: tests.envs_thirdparty:CountdownEnv``.

Countdown: the task gives a start number; each turn the agent says the next number down. A right
number earns 0.1 (a per-turn reward), reaching 0 ends the episode with reward 1; anything else is a
rejected action (an error observation). Tasks are a JSONL file, one ``{"id", "start", "split"}`` a line.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from lightning_agentrl.envs.base import Environment, StepResult

STEP_REWARD = 0.1


@dataclass(frozen=True)
class CountdownTask:
    id: str
    start: int
    split: str = "train"


class CountdownEnv(Environment):
    @classmethod
    def load_tasks(cls, path, *, split):
        lines = Path(path).read_text().splitlines()
        tasks = [CountdownTask(**json.loads(line)) for line in lines if line.strip()]
        return [task for task in tasks if split is None or task.split == split]

    def __init__(self, task: CountdownTask) -> None:
        self.task = task
        self.current = task.start

    async def reset(self) -> list[dict]:
        return [{"role": "system", "content": "Count down by one. Reply with the next number only."},
                {"role": "user", "content": f"Start: {self.task.start}"}]

    async def step(self, action_text: str) -> StepResult:
        said = re.findall(r"-?\d+", action_text)
        if not said or int(said[0]) != self.current - 1:
            return StepResult(f"no: the next number after {self.current}?", info={"tool": "say", "error": True})
        self.current -= 1
        if self.current == 0:
            return StepResult("done", reward=1.0, done=True, info={"tool": "say", "submitted": True})
        return StepResult(f"yes, now {self.current}", reward=STEP_REWARD, info={"tool": "say", "error": False})

    @property
    def state_text(self) -> str:
        return f"at {self.current}"


class BackendDown(Exception):
    """The third party's own infrastructure error type (say, its database client's)."""


class BackendSlow(Exception):
    """The third party's own timeout type."""


class FlakyCountdownEnv(CountdownEnv):
    """Countdown whose backend fails at the number ``fail_at`` with ``failure`` (an exception type),
    and maps its backend's errors to the trainer's in :meth:`classify_error`."""

    fail_at = 1
    failure: type[Exception] = BackendDown

    async def step(self, action_text: str) -> StepResult:
        if self.current - 1 == self.fail_at:
            raise self.failure(f"backend failed at {self.fail_at}")
        return await super().step(action_text)

    def classify_error(self, err: Exception):
        from lightning_agentrl.envs.base import EnvInfraError, ToolTimeout

        if isinstance(err, BackendDown):
            return EnvInfraError(f"{type(err).__name__}: {err}")
        if isinstance(err, BackendSlow):
            return ToolTimeout(str(err))
        return None


class NanCountdownEnv(CountdownEnv):
    """A user's bug: a reward computed as 0/0."""

    async def step(self, action_text: str) -> StepResult:
        result = await super().step(action_text)
        return StepResult(result.observation, reward=float("nan"), done=result.done, info=result.info)


class TupleStepEnv(CountdownEnv):
    """A gym habit: ``step`` returns a tuple."""

    async def step(self, action_text: str):
        result = await super().step(action_text)
        return result.observation, result.reward, result.done, result.info


class ToolDictEnv(CountdownEnv):
    """``info["tool"]`` given as the parsed call (a dict) instead of its name."""

    async def step(self, action_text: str) -> StepResult:
        result = await super().step(action_text)
        return StepResult(result.observation, result.reward, result.done, {**result.info, "tool": {"name": "say"}})


class SyncStepEnv(CountdownEnv):
    """``step`` written as a plain method."""

    def step(self, action_text: str) -> StepResult:  # type: ignore[override]
        return StepResult("no")


class FailingCloseEnv(CountdownEnv):
    """Its backend fails while the episode's resources are released."""

    async def close(self) -> None:
        from lightning_agentrl.envs.base import EnvInfraError

        raise EnvInfraError("backend gone while releasing the episode")


class AskEnv(CountdownEnv):
    """Countdown with a second tool: an action starting with ``ask:`` asks the frozen sub-agent
    (``env.sub_agent``) the rest of the line; its answer is the observation. Every answer is kept in
    :attr:`answers` (the test reads them back), with the sub-agent that gave it."""

    answers: list[tuple[str, object]] = []

    async def step(self, action_text: str) -> StepResult:
        if not action_text.startswith("ask:"):
            return await super().step(action_text)
        if self.sub_agent is None:
            return StepResult("no sub-agent in this run", info={"tool": "ask", "error": True})
        answer = await self.sub_agent.generate([{"role": "user", "content": action_text.removeprefix("ask:")}])
        type(self).answers.append((answer, self.sub_agent))
        return StepResult(f"sub-agent: {answer}", info={"tool": "ask"})


def _same_parity(a: str, b: str) -> float:
    return 1.0 if int(a.split()[-1]) % 2 == int(b.split()[-1]) % 2 else 0.0


class ParityCountdownEnv(CountdownEnv):
    """Countdown whose GiGPO similarity says two states are alike when their numbers share a parity."""

    state_similarity = staticmethod(_same_parity)


class CancellingCountdownEnv(CountdownEnv):
    """Its backend's own timeout surfaces as ``asyncio.CancelledError`` (a cancelled inner request) on the
    second step: nothing of the trainer cancelled the episode."""

    async def step(self, action_text: str) -> StepResult:
        import asyncio

        if self.current < self.task.start:
            raise asyncio.CancelledError("inner request cancelled")
        return await super().step(action_text)


class BuggyCountdownEnv(CountdownEnv):
    """A bug of the user's on the second step: a plain ``KeyError`` no ``classify_error`` maps."""

    async def step(self, action_text: str) -> StepResult:
        if self.current < self.task.start:
            return {}["missing"]
        return await super().step(action_text)


HUGE = 20_000


class HugeCountdownEnv(CountdownEnv):
    """Every observation carries a page of ``HUGE`` characters (a web page, a log) after its first line."""

    async def step(self, action_text: str) -> StepResult:
        result = await super().step(action_text)
        return StepResult(result.observation + "\n" + "x" * HUGE, result.reward, result.done, result.info)


class SurrogateCountdownEnv(CountdownEnv):
    """Text a web page may hold: lone surrogates (not UTF-8) in the opening messages and observations."""

    async def reset(self) -> list[dict]:
        system, user = await super().reset()
        return [{**system, "content": system["content"] + " \ud800"}, {**user, "content": user["content"] + " \udfff"}]

    async def step(self, action_text: str) -> StepResult:
        result = await super().step(action_text)
        return StepResult(result.observation + " \ud83d end", result.reward, result.done, result.info)


class IntStateCountdownEnv(CountdownEnv):
    """``state_text`` returns the number itself (an int), not text."""

    @property
    def state_text(self):  # type: ignore[override]
        return self.current


class MethodSimilarityCountdownEnv(CountdownEnv):
    """``state_similarity`` written as a plain method (it must be a staticmethod)."""

    def state_similarity(self, a: str, b: str) -> float:  # type: ignore[override]
        return 1.0 if a == b else 0.0


class DistanceCountdownEnv(CountdownEnv):
    """``state_similarity`` returns a distance (0 for equal states), not a similarity in [0, 1]."""

    state_similarity = staticmethod(lambda a, b: float(abs(len(a) - len(b)) + 5))


class SetStateCountdownEnv(CountdownEnv):
    """Keeps the numbers said in a set and its position as a tuple, without ``state_dict``."""

    def __init__(self, task: CountdownTask) -> None:
        super().__init__(task)
        self.said: set[int] = set()
        self.where = (task.start, 0)


class DownCountdownEnv(CountdownEnv):
    """Its own backend (no sandbox service) is down: every step raises ``EnvInfraError``."""

    async def step(self, action_text: str) -> StepResult:
        from lightning_agentrl.envs.base import EnvInfraError

        raise EnvInfraError("search backend unreachable")


BLOCK_S = 6.0


class BlockingCountdownEnv(CountdownEnv):
    """A common mistake: blocking work (``time.sleep``, a synchronous HTTP client) inside ``async def step``
    (once per process, so that a test does not wait for every episode's)."""

    blocked = False

    async def step(self, action_text: str) -> StepResult:
        import time

        if not BlockingCountdownEnv.blocked:
            BlockingCountdownEnv.blocked = True
            time.sleep(BLOCK_S)
        return await super().step(action_text)
