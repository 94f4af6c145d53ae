"""Fix-the-bug tasks in a remote sandbox: read_file, write_file, run, submit.

Each episode gets its own sandbox made from the task's workspace snapshot. ``submit`` scores the
agent's work with the hidden tests in a snapshot of its sandbox (a fork where the service has one,
``sandbox_client.scoring``): the hidden tests never enter the agent's sandbox, and the reward needs
the task's ``hidden_test_count`` passed tests in the scoring runner's own report.

State keys (for GiGPO) hash what the agent can observe: the files it has written so far and the
last observation. Two episodes that read the same file from the same start are in the same state.
``state_text`` is that state as text, which GiGPO's similarity mode compares.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from typing import TYPE_CHECKING

from lightning_agentrl.envs.base import (
    EnvInfraError,
    Environment,
    StepResult,
    ToolTimeout,
    clip,
    history_summary,
    step_each,
)
from lightning_agentrl.envs.tools import (
    CODING_TOOLS,
    ToolCallError,
    parse_tool_calls,
    tool_spec,
)
from lightning_agentrl.tasks import Task

if TYPE_CHECKING:
    from lightning_agentrl.settings import EnvSettings

STATE_TEXT_CHARS = 512  # the tail of the state text kept for GiGPO's similarity mode

SYSTEM_PROMPT = """You fix bugs in a Python repository. Reply with a short thought and exactly one tool call.
Tools:
{tools}"""
NATIVE_TOOLS_NOTE = "read_file, write_file, run and submit, as defined for this conversation."
"""What ``{tools}`` becomes when the chat template renders the tool definitions itself."""


class CodingEnv(Environment):
    """One episode of a bug-fix task against the sandbox service (``env.kind: coding``).

    Its sandbox client's errors reach the agent loop through :meth:`classify_error`:
    ``SandboxInfraError`` -> :class:`EnvInfraError`, ``CommandTimeout`` -> :class:`ToolTimeout`;
    ``SandboxRequestError`` (the agent asked for something impossible) is an error observation."""

    uses_sandbox = True
    runs_hidden_tests = True

    @classmethod
    def from_settings(cls, task: Task, *, client, settings: EnvSettings, native_tools: bool) -> CodingEnv:
        return cls(
            client, task, tool_timeout_s=settings.tool_timeout_s, max_observation_chars=settings.max_observation_chars,
            system_prompt=settings.system_prompt, native_tools=native_tools,
        )

    def __init__(
        self,
        client,
        task: Task,
        *,
        tool_timeout_s: float = 20.0,
        max_observation_chars: int = 2000,
        scoring_timeout_s: float | None = None,
        system_prompt: str | None = None,
        native_tools: bool = False,
    ) -> None:
        self.client = client
        self.task = task
        self.tool_timeout_s = tool_timeout_s
        self.max_observation_chars = max_observation_chars
        self.scoring_timeout_s = scoring_timeout_s or task.scoring_timeout_s
        self.system_prompt = SYSTEM_PROMPT if system_prompt is None else system_prompt
        # The chat template's own tool format (``tools=``) where it has one: the model sees tools as
        # its family was trained to; else the tools are described in the system prompt.
        self.tools: list[dict] | None = [tool.schema() for tool in CODING_TOOLS] if native_tools else None
        self.sandbox_id: str | None = None
        self._written: dict[str, str] = {}
        self._last_observation = ""
        self.score = None

    async def reset(self) -> list[dict]:
        self.sandbox_id = await self.client.create(dict(self.task.files))
        # what only training has: the hidden tests, for a privileged critic (algorithm.privileged_critic)
        self.critic_context = clip("".join(f"[hidden test {path}]\n{content}\n"
                                           for path, content in sorted(self.task.hidden_files.items())),
                                   self.max_observation_chars)
        return self.opening_messages(self.task.prompt, self.system_prompt, native_tools=self.tools is not None)

    @staticmethod
    def opening_messages(prompt: str, system_prompt: str | None = None, *, native_tools: bool = False) -> list[dict]:
        """The system and user messages every episode opens with (``system_prompt`` as in
        ``env.system_prompt``: None = the built-in one; its ``{tools}`` becomes the tools' text, or a
        note naming them when the chat template renders their schemas)."""
        tools = NATIVE_TOOLS_NOTE if native_tools else "\n".join(tool.render() for tool in CODING_TOOLS)
        system = SYSTEM_PROMPT if system_prompt is None else system_prompt
        # replace, not str.format: a custom prompt may contain other braces (JSON examples)
        return [{"role": "system", "content": system.replace("{tools}", tools)}, {"role": "user", "content": prompt}]

    @property
    def state_key(self) -> str:
        payload = json.dumps([sorted(self._written.items()), self._last_observation])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    @property
    def state_text(self) -> str:
        # at most STATE_TEXT_CHARS: GiGPO's similarity (an LCS) costs the product of two lengths. The
        # files and the observation get half each, so a long observation never hides the files (a
        # difference early in files longer than that still can: similar, not equal, keys differ)
        half = STATE_TEXT_CHARS // 2
        files = "".join(f"[file {path}]\n{content}\n" for path, content in sorted(self._written.items()))
        return f"{files[-half:]}[last observation]\n{self._last_observation[-half:]}"

    async def step(self, action_text: str) -> StepResult:
        assert self.sandbox_id is not None, "reset() first"
        try:
            calls = parse_tool_calls(action_text, CODING_TOOLS, self.call_format)
        except ToolCallError as err:
            return self._observe(f"error: {err}", error=True)
        return await step_each(calls, self._call, self.max_calls_per_turn)

    async def _call(self, call) -> StepResult:
        from sandbox_client import SandboxRequestError
        from sandbox_client.scoring import score_submission

        info = {"tool": call.name}
        try:
            if call.name == "submit":
                self.score = await score_submission(
                    self.client,
                    task_files=dict(self.task.files),
                    hidden_files=dict(self.task.hidden_files),
                    agent_sandbox_id=self.sandbox_id,
                    test_command=self.task.hidden_test_command,
                    timeout_s=self.scoring_timeout_s,
                    required_passed=self.task.hidden_test_count,
                )
                info.update(submitted=True, scoring_timed_out=self.score.timed_out,
                            workspace_unscorable=self.score.unscorable)
                return StepResult("submitted", reward=self.score.reward, done=True, info=info)
            if call.name == "read_file":
                text = await self.client.read_file(self.sandbox_id, call.arguments["path"])
                return self._observe(text, **info)
            if call.name == "write_file":
                path, content = call.arguments["path"], call.arguments["content"]
                await self.client.write_file(self.sandbox_id, path, content)
                self._written[path] = content
                return self._observe(f"wrote {len(content)} characters to {path}", **info)
            result = await self.client.exec(self.sandbox_id, call.arguments["command"], timeout_s=self.tool_timeout_s)
            body = f"exit code {result.exit_code}\n{result.stdout}{result.stderr}"
            return self._observe(body, **info)
        except SandboxRequestError as err:  # the agent asked for something impossible
            return self._observe(f"error: {err}", error=True, **info)

    def _observe(self, text: str, error: bool = False, **info) -> StepResult:
        self._last_observation = clip(text, self.max_observation_chars)  # kept with a parked episode's state
        return StepResult(text, info={**info, "error": error})  # the agent loop clips what the agent sees

    def demonstration(self, rng) -> list[str] | None:
        """The task's reference fix (its ``solution/`` files) as calls: read every workspace file the fix does
        not replace (what it needs to know, e.g. the key to copy), write each file of the fix, submit. None for a
        task without a solution."""
        if not self.task.solution_files:
            return None
        read, write, submit = (tool_spec(name) for name in ("read_file", "write_file", "submit"))
        reads = [read.call(path=path) for path in sorted(set(self.task.files) - set(self.task.solution_files))]
        writes = [write.call(path=path, content=text) for path, text in sorted(self.task.solution_files.items())]
        return [*reads, *writes, submit.call()]

    def classify_error(self, err: Exception) -> EnvInfraError | ToolTimeout | None:
        from sandbox_client import CommandTimeout, SandboxInfraError

        if isinstance(err, CommandTimeout):
            return ToolTimeout(f"{type(err).__name__}: {err}")
        if isinstance(err, SandboxInfraError):
            return EnvInfraError(f"{type(err).__name__}: {err}")
        return None

    def summarize_history(self, history: list[dict], *, max_observation_chars: int = 1000) -> str:
        """The generic summary plus the files written so far (from the history's ``write_file`` calls)."""
        written: list[str] = []
        for step in history:
            try:
                calls = parse_tool_calls(step.get("action", ""), CODING_TOOLS, self.call_format)
            except ToolCallError:
                continue
            for call in calls:
                if call.name == "write_file" and call.arguments["path"] not in written:
                    written.append(call.arguments["path"])
        facts = ("Files written: " + (", ".join(written) or "none"),)
        return history_summary(history, max_observation_chars=max_observation_chars, facts=facts)

    def state_dict(self) -> dict:
        """What a parked episode needs to continue in this sandbox (SPEC §6 partial rollouts)."""
        return {
            "sandbox_id": self.sandbox_id,
            "written": dict(self._written),
            "last_observation": self._last_observation,
        }

    def load_state_dict(self, state: dict) -> None:
        self.sandbox_id = state["sandbox_id"]
        self._written = dict(state["written"])
        self._last_observation = state["last_observation"]

    async def close(self) -> None:
        if self.sandbox_id is not None:
            sandbox_id, self.sandbox_id = self.sandbox_id, None
            try:  # one attempt's time at most: after a frozen service's timeout, do not wait for it again
                await asyncio.wait_for(self.client.delete(sandbox_id), timeout=self.client.timeout_s)
            except Exception:  # the TTL reaper collects it; never fail an episode on cleanup
                pass
