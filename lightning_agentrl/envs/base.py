"""The environment contract: what a user implements to train an agent on their own world.

A subclass of :class:`Environment` is named in the settings, ``env.kind: my_pkg.envs:SearchEnv``
(or a shipped name, ``coding`` or ``keydoor``), and the trainer builds one per episode with
:meth:`Environment.from_settings`. Everything here is message space: text in, text out; token ids
never appear (they are the agent loop's, :mod:`lightning_agentrl.rollout.chat`).

Errors: a tool failure the agent caused is an observation (``info["error"]``), never an exception.
The environment's own infrastructure failing raises :class:`EnvInfraError` (the episode ends with
``sandbox_error`` and is excluded from training, not scored 0); a tool past its time limit raises
:class:`ToolTimeout` (the episode ends with ``timeout``). An environment whose backend raises its
own exception types maps them in :meth:`Environment.classify_error`; the agent loop catches only
these two types. docs/environments.md walks through writing one.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from lightning_agentrl.envs.call_formats import CallFormat
    from lightning_agentrl.settings import EnvSettings

SUMMARY_HEADER = "Earlier turns of this episode were summarized to fit the context."


class EnvInfraError(Exception):
    """The environment's infrastructure failed (a lost sandbox, an unreachable service), not the agent:
    the episode ends with ``sandbox_error`` and is excluded from training. The trajectory's
    ``info["sandbox_error"]`` is its message, after the type name when it was raised directly (an error
    made by :meth:`Environment.classify_error` carries its own, e.g. ``"SandboxNotFound: ..."``)."""


class ToolTimeout(Exception):
    """A tool ran past its time limit: the episode ends with ``timeout`` (``info["timeout"] = "tool"``)."""


@dataclass
class StepResult:
    """What one action led to. ``reward`` is this turn's reward (``Turn.reward``, per-turn credit);
    with ``done`` it is also the episode's final reward. ``info``: ``tool`` (the tool called),
    ``error`` (the action was rejected: counts toward ``env.max_tool_errors``), ``submitted``,
    ``scoring_timed_out`` (the episode ends with ``scoring_timeout``), ``workspace_unscorable`` (the submitted
    workspace could not be snapshotted for scoring: ``unscorable_workspace``)."""

    observation: str
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)
    tool_results: tuple[str, ...] = ()
    """One result per call where the action held several (:func:`step_each`): each is shown to the agent as a tool
    message of its own; ``observation`` is then their text joined (what histories and summaries keep)."""


async def step_each(calls: list, run_one, max_calls: int = 8) -> StepResult:
    """Run an action's tool calls in order (``await run_one(call) -> StepResult``), up to the one that ends the
    episode: one call's result as is; several as one result with each call's ``tool_results``, ``info["tool"]``
    the tools called (comma-separated) and ``error`` only where every call failed. The reward is what one call
    per turn would give: the ending call's reward where one ends the episode (the episode's reward, not a sum
    with the calls before it), else the calls' shaped rewards summed. More than ``max_calls`` calls
    (``env.max_calls_per_turn``) run none and are a tool error: one reply must not walk past ``env.max_turns``."""
    if len(calls) > max_calls:
        return StepResult(f"error: {len(calls)} tool calls in one reply; at most {max_calls} (env.max_calls_per_turn)",
                          info={"tool": None, "error": True})
    results = []
    for call in calls:
        results.append(await run_one(call))
        if results[-1].done:
            break
    if len(results) == 1:
        return results[0]
    tools = [r.info["tool"] for r in results if r.info.get("tool")]
    info = {k: v for r in results for k, v in r.info.items()}
    info.update(tool=",".join(tools) or None, error=all(r.info.get("error") for r in results))
    reward = results[-1].reward if results[-1].done else sum(r.reward for r in results)
    return StepResult("\n\n".join(r.observation for r in results), reward=reward,
                      done=results[-1].done, info=info, tool_results=tuple(r.observation for r in results))


class EnvContractError(TypeError):
    """An environment returned something its contract does not allow (the message names its class and method)."""


class EnvError(RuntimeError):
    """An environment's own code raised what its :meth:`Environment.classify_error` does not map (a bug):
    the run stops, and the message says ``<Class>.<method> raised <Type>: <message>`` (the original
    exception is the cause, and its traceback is logged)."""


def encodable(text: str) -> str:
    """``text`` with what UTF-8 cannot encode (a lone surrogate, as a web page may hold) replaced by ``?``:
    the tokenizer takes only encodable text.

    >>> encodable("a\\ud800b")
    'a?b'
    """
    return text.encode("utf-8", "replace").decode("utf-8")


def checked_messages(env: Environment, messages: Any) -> list[dict]:
    """``reset``'s opening messages, checked: a list of ``{"role": str, "content": str, ...}`` (copies,
    their contents made :func:`encodable`)."""
    ok = isinstance(messages, list) and messages and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in messages)
    if not ok:
        raise EnvContractError(f"{type(env).__qualname__}.reset must return a non-empty list of "
                               f"{{'role': str, 'content': str}} messages, got {_short(messages)}")
    return [{**m, "content": encodable(m["content"])} for m in messages]


def checked_step(env: Environment, result: Any, *, max_observation_chars: int | None = None) -> StepResult:
    """``step``'s result, checked: a :class:`StepResult` with a str observation, a finite number reward
    (a NaN reward would train every weight to NaN), a bool ``done`` and a dict ``info``. The observation
    is made :func:`encodable` and :func:`clip`-ped to ``max_observation_chars`` (``env.max_observation_chars``)."""
    name = f"{type(env).__qualname__}.step"
    if not isinstance(result, StepResult):
        raise EnvContractError(f"{name} must return a StepResult, got {_short(result)}")
    reward = result.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise EnvContractError(f"{name} returned reward {reward!r}; it must be a finite number")
    if not isinstance(result.observation, str):
        raise EnvContractError(f"{name} returned observation {_short(result.observation)}; it must be a str")
    if not isinstance(result.done, bool) or not isinstance(result.info, dict):
        raise EnvContractError(f"{name} returned done={result.done!r} and info={_short(result.info)}; they must "
                               "be a bool and a dict")
    tool = result.info.get("tool")
    if tool is not None and not isinstance(tool, str):
        raise EnvContractError(f"{name} returned info['tool'] {_short(tool)}; it must be the tool's name (a str) "
                               "or None")
    if not isinstance(result.tool_results, tuple) or not all(isinstance(r, str) for r in result.tool_results):
        raise EnvContractError(f"{name} returned tool_results {_short(result.tool_results)}; it must be a tuple of str")

    def checked(text: str) -> str:
        return encodable(text if max_observation_chars is None else clip(text, max_observation_chars))

    return replace(result, observation=checked(result.observation),
                   tool_results=tuple(checked(text) for text in result.tool_results))


def checked_critic_context(env: Environment) -> str | None:
    """``env.critic_context``, checked to be a str or None (made :func:`encodable`)."""
    text = env.critic_context
    if text is not None and not isinstance(text, str):
        raise EnvContractError(f"{type(env).__qualname__}.critic_context must be a str or None, got {_short(text)}")
    return None if text is None else encodable(text)


def checked_state_text(env: Environment) -> str:
    """``env.state_text``, checked to be a str (GiGPO groups turns by it)."""
    text = env.state_text
    if not isinstance(text, str):
        raise EnvContractError(f"{type(env).__qualname__}.state_text must be a str, got {_short(text)}")
    return text


def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:120]}{'...' if len(text) > 120 else ''}"


@runtime_checkable
class EnvTask(Protocol):
    """A task as the trainer sees it, whatever the environment: any object with an ``id`` (a non-empty str,
    unique in its source). What else it holds is the environment's (the coding environment's
    :class:`~lightning_agentrl.tasks.Task`, a key-and-door map, a user's dataclass)."""

    id: str


@runtime_checkable
class SubAgent(Protocol):
    """A frozen second model an environment may call as a tool (multi-agent, ``env.sub_agent``): the rollout
    side builds it and sets :attr:`Environment.sub_agent`. Its answer is what the environment makes of it, an
    observation: it enters the trajectory with loss mask 0, and its weights never train."""

    async def generate(self, messages: list[dict]) -> str:
        """The sub-agent's answer (text) to a chat conversation (``{"role", "content"}`` messages)."""
        ...


class Environment(ABC):
    """One episode's world. Subclass it, implement :meth:`reset`, :meth:`step` and :attr:`state_text`,
    and override the rest where the defaults do not fit."""

    uses_sandbox: bool = False
    """It runs the agent's actions in the sandbox service (the coding environment). When False, ``fit``,
    ``evaluate`` and ``validate`` neither start nor check the service, and :meth:`from_settings` gets
    ``client=None``."""

    runs_hidden_tests: bool = False
    """Its reward comes from hidden tests that the sandbox service's judge runs (the coding environment):
    the service must then keep the judge from the agent's code (``sandbox.judge_isolation``)."""

    sub_agent: SubAgent | None = None
    """The frozen sub-agent named by ``env.sub_agent`` (set on each episode's environment after
    :meth:`from_settings`), or None when the settings name none. An environment offers it as a tool:
    ``StepResult(observation=await self.sub_agent.generate(messages))``."""

    critic_context: str | None = None
    """Text only the critic reads (SWEET-RL's training-time information: the reference answer, the hidden
    tests), read after :meth:`reset`; the policy never sees it. With ``algorithm.privileged_critic`` the value
    head reads it before every segment of the episode through a second forward of the trunk. None: nothing."""

    call_format: CallFormat | None = None
    """How the policy writes tool calls (``env.tool_call_format``, set on each episode's environment after
    :meth:`from_settings`); pass it to :func:`~lightning_agentrl.envs.tools.parse_tool_calls`. None: Hermes,
    Mistral or Llama 3 JSON."""

    max_calls_per_turn: int = 8
    """``env.max_calls_per_turn``, set with :attr:`call_format`; pass it to :func:`step_each`."""

    tools: list[dict] | None = None
    """The tools as JSON schemas (OpenAI function format, :meth:`~lightning_agentrl.envs.tools.ToolSpec.schema`)
    for the chat template's ``tools=`` argument; None when the opening messages describe them."""

    # -- building ----------------------------------------------------------------------------------
    @classmethod
    def load_tasks(cls, path: str | Path, *, split: str | None) -> list[Any]:
        """The tasks at ``env.tasks`` of ``split`` ("train", "test"; None = all). A task is any object
        with an ``id`` (str). Default: the task-folder format of :mod:`lightning_agentrl.tasks`. Raise
        ``FileNotFoundError`` or ``ValueError`` naming what is wrong; the trainer reports it as ``env.tasks``."""
        from lightning_agentrl.tasks import load_tasks

        return load_tasks(path, split=split)

    @classmethod
    def from_settings(cls, task: Any, *, client: Any, settings: EnvSettings, native_tools: bool) -> Environment:
        """One episode's environment for ``task``. ``client``: a sandbox client where :attr:`uses_sandbox`
        (environments that run code remotely), else None; ``settings``: the ``env`` section; ``native_tools``: the chat template renders
        :attr:`tools` (else describe them in the opening messages). Default: ``cls(task)``."""
        return cls(task)

    # -- the episode -------------------------------------------------------------------------------
    @abstractmethod
    async def reset(self) -> list[dict]:
        """Start the episode; return the opening chat messages (system, user)."""

    @abstractmethod
    async def step(self, action_text: str) -> StepResult:
        """Apply the agent's action (its decoded text; read its tool calls with
        :func:`~lightning_agentrl.envs.tools.parse_tool_calls` in :attr:`call_format`, run them with
        :func:`step_each`) and say what it led to."""

    async def close(self) -> None:
        """Release what the episode holds (called once, also after errors). Default: nothing to release."""
        return None

    # -- demonstrations (``python -m lightning_agentrl sft``) -------------------------------------
    def demonstration(self, rng: random.Random) -> list[str] | None:
        """The actions of a solution of this episode's task, one per turn, written as the agent would write
        them (the tool-call form :func:`~lightning_agentrl.envs.tools.parse_tool_call` reads); called after
        :meth:`reset`. ``sft`` plays them through :meth:`step` (the observations are the environment's own) to
        build supervised demonstrations. ``rng`` may choose among equally good solutions, so several
        demonstrations of one task differ. Default: None, no solver (``sft`` refuses the environment)."""
        return None

    # -- GiGPO anchor states -----------------------------------------------------------------------
    @property
    @abstractmethod
    def state_text(self) -> str:
        """The observable state the next action starts from, as text. GiGPO groups turns that start
        from the same state (``algorithm.gigpo_similarity``: from similar enough texts): equal states
        must give equal texts, whatever path led there. Keep it short (the similarity costs the product
        of two lengths)."""

    state_similarity: Callable[[str, str], float] | None = None
    """GiGPO's similarity of two :attr:`state_text` values, in [0, 1] (similarity mode,
    ``algorithm.gigpo_similarity``: a turn joins an anchor group whose first state is more similar than
    that). None: the default text similarity (longest common subsequence). Override it as a
    ``staticmethod`` where your states have a better measure (the same room, the same page)."""

    @property
    def state_key(self) -> str:
        """The exact GiGPO anchor: by default a hash of :attr:`state_text`."""
        return hashlib.sha256(self.state_text.encode()).hexdigest()[:16]

    # -- errors and summaries ----------------------------------------------------------------------
    def classify_error(self, err: Exception) -> EnvInfraError | ToolTimeout | None:
        """Map an exception of this environment's backend to :class:`EnvInfraError` or
        :class:`ToolTimeout`; None lets it propagate (a bug: the run fails loudly)."""
        return None

    def summarize_history(self, history: list[dict], *, max_observation_chars: int = 1000) -> str:
        """The summary that opens a new segment with ``env.summarizer: rule``. ``history``: one dict per
        step, ``{"action", "observation", "tool"}`` (the last observation may be unseen by the agent)."""
        return history_summary(history, max_observation_chars=max_observation_chars)


def history_summary(history: list[dict], *, max_observation_chars: int = 1000, facts: tuple[str, ...] = ()) -> str:
    """A summary of a tool history without a model: the tools used, ``facts`` (environment-specific
    lines) and the latest tool output.

    >>> print(history_summary([{"action": "...", "observation": "ok", "tool": "run"}], facts=("Files written: a.py",)))
    Earlier turns of this episode were summarized to fit the context.
    Tools used: run x1
    Files written: a.py
    Latest tool output:
    ok
    """
    tools: dict[str, int] = {}
    for step in history:
        name = step.get("tool") or "invalid call"
        tools[name] = tools.get(name, 0) + 1
    lines = [SUMMARY_HEADER, "Tools used: " + (", ".join(f"{name} x{n}" for name, n in tools.items()) or "none")]
    lines.extend(facts)
    if history:
        lines.append("Latest tool output:\n" + clip(history[-1].get("observation", ""), max_observation_chars))
    return "\n".join(lines)


def load_jsonl_tasks(path: str | Path, parse: Callable[[Any, str], Any], *, split: str | None, what: str) -> list:
    """The tasks of a JSONL file, or of every ``*.jsonl`` in a folder, one a line, each made by
    ``parse(data, "file:line")`` (which raises ``ValueError`` naming that place); those of ``split`` (None:
    all), sorted by id. ``what`` names the tasks in the errors (``keydoor``)."""
    root = Path(path)
    files = sorted(root.glob("*.jsonl")) if root.is_dir() else [root]
    if not files or not files[0].is_file():
        raise FileNotFoundError(f"no {what} tasks (a .jsonl file or a folder of them): {root}")
    tasks = []
    for file in files:
        for number, line in enumerate(file.read_text().splitlines(), 1):
            if line.strip():
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(f"{file}:{number}: not JSON: {err.msg}") from None
                tasks.append(parse(data, f"{file}:{number}"))
    if len({task.id for task in tasks}) != len(tasks):
        raise ValueError(f"{root}: task ids repeat")
    return sorted((t for t in tasks if split is None or t.split == split), key=lambda t: t.id)


def clip(text: str, max_chars: int) -> str:
    """``text`` cut to ``max_chars`` with a marker saying how much was cut."""
    return text if len(text) <= max_chars else text[:max_chars] + f"\n[... {len(text) - max_chars} more characters cut]"
