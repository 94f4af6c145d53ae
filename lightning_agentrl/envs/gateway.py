"""Agents that bring their own loop: ``env.kind: gateway``.

An existing agent, written against the OpenAI API, is trained unchanged: each episode runs it once with
its own base URL and API key (those of the rollout's gateway, :mod:`lightning_agentrl.rollout.gateway`),
and the number it returns is the episode's reward. The agent is either

- a function, ``env.agent: my_pkg.agent:run``, ``async def run(task: dict, base_url: str, api_key: str) ->
  float`` (a plain ``def`` runs in a daemon thread, so a synchronous client does not block the rollout;
  a thread cannot be interrupted: past the episode's time limit its calls are refused), or
- a command, ``env.agent_command: [python, my_agent.py]``, started with ``OPENAI_BASE_URL`` and
  ``OPENAI_API_KEY`` in its environment and the task as JSON on its stdin; its last stdout line is
  ``{"reward": R}``. It runs in a process group of its own, killed whole when the episode ends.

Tasks are a JSONL file (or a folder of them) at ``env.tasks``: one JSON object a line with a unique
string ``id``; the object is what the agent gets. ``split`` (``train`` when absent) selects the
training and held-out tasks. This module is message space only: the token ids are the gateway's.

An agent that raises, exits non-zero, or returns no finite number raises :class:`AgentError`: the
episode ends with ``agent_error`` and is excluded from training (the agent's fault is not the
policy's), its last error line kept in ``info["agent_error"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import importlib
import inspect
import json
import math
import os
import signal
import threading
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_agentrl.envs.base import EnvError, Environment, load_jsonl_tasks

if TYPE_CHECKING:
    from lightning_agentrl.settings import EnvSettings


class AgentError(Exception):
    """The agent failed (raised, exited non-zero, returned no finite reward): the episode ends with
    ``agent_error``; the message is the last line of what it said."""


@dataclass(frozen=True)
class AgentTask:
    """One line of the task file: its ``id``, ``split`` and the whole object (what the agent gets)."""

    id: str
    data: dict = field(hash=False)
    split: str = "train"


def _parse_task(data: Any, where: str) -> AgentTask:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: a task is a JSON object, got {type(data).__name__}")
    task_id, split = data.get("id"), data.get("split", "train")
    if not isinstance(task_id, str) or not task_id:
        raise ValueError(f"{where}: a task needs an `id` (a non-empty string), got {task_id!r}")
    if not isinstance(split, str):
        raise ValueError(f"{where}: `split` must be a string, got {split!r}")
    return AgentTask(task_id, data, split)


@cache
def load_agent(spec: str):
    """The function ``spec`` (``pkg.module:function``) names; ``ValueError`` saying what is wrong.

    >>> load_agent("json:loads")
    Traceback (most recent call last):
    ValueError: json:loads must take (task, base_url, api_key): too many positional arguments
    """
    module_name, sep, name = spec.partition(":")
    if not sep or not module_name or not name:
        raise ValueError(f"{spec!r} is not a function path like my_pkg.agent:run")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or whatever the module raises while it runs
        raise ValueError(f"cannot import {module_name!r}: {type(err).__name__}: {err}") from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"module {module_name!r} has no function {name!r}")
    try:
        inspect.signature(function).bind({}, "url", "key")
    except (TypeError, ValueError) as err:
        raise ValueError(f"{spec} must take (task, base_url, api_key): {err}") from None
    return function


def checked_reward(value: Any, source: str) -> float:
    """The agent's reward as a float; :class:`AgentError` unless it is a finite number."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise AgentError(f"{source} returned reward {value!r}; it must be a finite number")
    return float(value)


def last_line(text: str) -> str:
    """The last non-empty line of ``text`` (an error's last line says what went wrong), at most 500 chars."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:500] if lines else ""


class GatewayEnv(Environment):
    """One episode of an external agent. The gateway plays it (:meth:`run_agent`); the built-in loop's
    ``reset`` and ``step`` are never called."""

    def __init__(self, task: AgentTask, settings: EnvSettings) -> None:
        self.task = task
        self.agent, self.agent_command = settings.agent, settings.agent_command

    @classmethod
    def load_tasks(cls, path: str | Path, *, split: str | None) -> list[AgentTask]:
        return load_jsonl_tasks(path, _parse_task, split=split, what="agent")

    @classmethod
    def from_settings(cls, task, *, client, settings: EnvSettings, native_tools: bool) -> GatewayEnv:
        return cls(task, settings)

    async def reset(self) -> list[dict]:
        raise EnvError("env.kind=gateway: the agent drives its own episode through the gateway")

    async def step(self, action_text: str):
        raise EnvError("env.kind=gateway: the agent drives its own episode through the gateway")

    @property
    def state_text(self) -> str:
        return ""

    async def run_agent(self, base_url: str, api_key: str) -> float:
        """Run the agent once on this task; its reward. Raises :class:`AgentError`."""
        if self.agent is not None:
            # a copy: the G agents of a group share the task, and an agent may change what it gets
            return await run_function(load_agent(self.agent), copy.deepcopy(self.task.data), base_url, api_key)
        return await run_command(self.agent_command, self.task.data, base_url, api_key)


async def run_function(function, task: dict, base_url: str, api_key: str) -> float:
    name = getattr(function, "__qualname__", repr(function))
    try:
        if inspect.iscoroutinefunction(function):
            value = await function(task, base_url, api_key)
        else:
            value = await in_daemon_thread(function, task, base_url, api_key)
    except (Exception, SystemExit) as err:  # noqa: BLE001 - whatever the agent raises ends its episode, not the run
        raise AgentError(f"{name} raised {type(err).__name__}: {last_line(str(err)) or 'no message'}") from err
    return checked_reward(value, name)


async def in_daemon_thread(function, *args):
    """``function(*args)`` in a daemon thread of its own. Not ``asyncio.to_thread``: a thread cannot be
    interrupted, and the executor's threads are joined when the interpreter exits, so one agent hung past
    its episode's time limit would keep the finished run from exiting."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(outcome: dict) -> None:
        if future.done():  # cancelled: the episode timed out and moved on
            return
        if "error" in outcome:
            future.set_exception(outcome["error"])
        else:
            future.set_result(outcome["value"])

    def target() -> None:
        try:
            outcome = {"value": function(*args)}
        except BaseException as err:  # noqa: BLE001 - handed to the awaiting episode
            outcome = {"error": err}
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody waits any more
            loop.call_soon_threadsafe(settle, outcome)

    threading.Thread(target=target, name="agent", daemon=True).start()
    return await future


async def run_command(argv: list[str], task: dict, base_url: str, api_key: str) -> float:
    """Run ``argv`` with the task on stdin; its last stdout line's reward. Its process group is killed when
    this returns or is cancelled (a timeout), so no child outlives the episode."""
    environment = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": api_key}
    try:
        process = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            env=environment, start_new_session=True,
        )
    except OSError as err:
        raise AgentError(f"cannot start {argv[0]}: {err}") from err
    try:
        out, err = await process.communicate(json.dumps(task).encode())
    finally:
        _kill_group(process.pid)
        if process.returncode is None:
            await process.wait()
    if process.returncode != 0:
        said = last_line(err.decode(errors="replace")) or last_line(out.decode(errors="replace"))
        raise AgentError(f"{argv[0]} exited with status {process.returncode}: {said or 'no output'}")
    return _reported_reward(out.decode(errors="replace"), argv[0])


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # the group is gone already
        pass


def _reported_reward(stdout: str, name: str) -> float:
    line = last_line(stdout)
    try:
        report = json.loads(line)
    except json.JSONDecodeError:
        report = None
    if not isinstance(report, dict) or "reward" not in report:
        raise AgentError(f'{name}: its last stdout line must be {{"reward": R}}, got {line[:200]!r}')
    return checked_reward(report["reward"], name)
