"""A coding harness run unchanged inside the task's sandbox: ``env.kind: gateway`` with ``env.agent_in_sandbox``.

A real harness (mini-swe-agent, a coding CLI) runs shell commands where it starts and calls a model over the
OpenAI API. Run inside the task's sandbox, its commands act on the task's workspace, and its only way out is
its episode's gateway URL (``sandbox_server.gateway_proxy``): each episode

1. creates a sandbox from the task's workspace snapshot (the hidden tests never enter it);
2. runs ``env.agent_command`` there (working folder: the workspace; the harness itself comes from the service's
   read-only ``/tools``, installed by the operator, never by the task) with ``OPENAI_BASE_URL`` (the episode's
   gateway URL as the sandbox reaches it, ``http://127.0.0.1:PORT/episodes/<id>/v1``), ``OPENAI_API_KEY``,
   ``TASK_PROMPT`` (the task's prompt), ``AGENT_TIMEOUT_S`` (its limit in seconds) and the task ``{"id", "prompt"}``
   as JSON on stdin, for at most the episode's time left less the task's ``scoring_timeout_s`` (kept for step 3;
   past it the service kills the command's whole process tree);
3. when the harness exits 0, scores the workspace with the hidden tests exactly as the coding environment's
   ``submit`` does (:func:`sandbox_client.scoring.score_submission`: a copy of the sandbox, the judge under
   another uid): that is the episode's reward.

A harness that exits non-zero is the agent's failure (:class:`AgentError`, ``agent_error``, excluded and
counted); the sandbox service failing is infrastructure (:class:`EnvInfraError`, ``sandbox_error``).
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from lightning_agentrl.envs.base import EnvInfraError
from lightning_agentrl.envs.gateway import AgentError, GatewayEnv, last_line
from lightning_agentrl.tasks import Task

if TYPE_CHECKING:
    from lightning_agentrl.settings import EnvSettings


def url_inside(base_url: str) -> str:
    """The gateway URL as the sandbox reaches it: the same port and path on the sandbox's own loopback.

    >>> url_inside("http://10.0.0.5:8123/episodes/g0-e1/v1")
    'http://127.0.0.1:8123/episodes/g0-e1/v1'
    """
    parts = urlsplit(base_url)
    return urlunsplit((parts.scheme, f"127.0.0.1:{parts.port}", parts.path, "", ""))


class SandboxAgentEnv(GatewayEnv):
    """One episode of a harness in the task's sandbox; the gateway plays it (:meth:`run_agent`)."""

    uses_sandbox = True
    runs_hidden_tests = True

    def __init__(self, task: Task, settings: EnvSettings, client) -> None:
        self.task, self.client = task, client
        self.agent, self.agent_command = None, settings.agent_command
        self.episode_timeout_s = settings.episode_timeout_s
        self.sandbox_id: str | None = None
        self.score = None

    @classmethod
    def load_tasks(cls, path, *, split):
        from lightning_agentrl.tasks import load_tasks

        return load_tasks(path, split=split)

    @classmethod
    def from_settings(cls, task, *, client, settings: EnvSettings, native_tools: bool) -> SandboxAgentEnv:
        return cls(task, settings, client)

    async def run_agent(self, base_url: str, api_key: str) -> float:
        """Run the harness in a fresh sandbox of the task, then score its workspace; the reward."""
        from sandbox_client import CommandTimeout, SandboxError

        started = time.monotonic()
        try:
            self.sandbox_id = await self.client.create(dict(self.task.files))
            # the scoring runs inside the episode's time: a harness that ends within its own limit is always scored
            left = max(self.episode_timeout_s - (time.monotonic() - started) - self.task.scoring_timeout_s, 0.1)
            environment = {"OPENAI_BASE_URL": url_inside(base_url), "OPENAI_API_KEY": api_key,
                           "TASK_PROMPT": self.task.prompt, "AGENT_TIMEOUT_S": f"{left:.1f}"}
            result = await self.client.exec(
                self.sandbox_id, self.agent_command, stdin=json.dumps({"id": self.task.id, "prompt": self.task.prompt}),
                env=environment, timeout_s=left, gateway_url=base_url)
        except CommandTimeout:
            raise TimeoutError("the harness ran past env.episode_timeout_s; its process tree was killed") from None
        except SandboxError as err:  # the service failed, or refused what this run asks of it (no bwrap)
            raise EnvInfraError(f"{type(err).__name__}: {err}") from err
        if result.exit_code != 0:
            said = last_line(result.stderr) or last_line(result.stdout)
            raise AgentError(f"{self.agent_command[0]} exited with status {result.exit_code}: {said or 'no output'}")
        return await self._score()

    async def _score(self) -> float:
        """The hidden tests on the workspace, as ``submit`` runs them (CodingEnv.step)."""
        from sandbox_client import SandboxError
        from sandbox_client.scoring import score_submission

        try:
            self.score = await score_submission(
                self.client, task_files=dict(self.task.files), hidden_files=dict(self.task.hidden_files),
                agent_sandbox_id=self.sandbox_id, test_command=self.task.hidden_test_command,
                timeout_s=self.task.scoring_timeout_s, required_passed=self.task.hidden_test_count)
        except SandboxError as err:
            raise EnvInfraError(f"{type(err).__name__}: {err}") from err
        return self.score.reward

    @property
    def episode_info(self) -> dict:
        """What the trajectory records of the scoring (as the coding environment's ``submit`` does)."""
        if self.score is None:
            return {}
        return {"scoring_timed_out": self.score.timed_out, "workspace_unscorable": self.score.unscorable,
                "hidden_passed": self.score.num_passed}

    async def close(self) -> None:
        if self.sandbox_id is not None:
            sandbox_id, self.sandbox_id = self.sandbox_id, None
            try:  # deleting it also kills what still runs there
                await self.client.delete(sandbox_id)
            except Exception:  # noqa: BLE001 - the TTL reaper collects it; never fail an episode on cleanup
                pass
