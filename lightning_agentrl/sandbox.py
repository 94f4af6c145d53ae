"""The sandbox service as a run uses it: whether the environment needs one, and the object that stands for it.

:func:`make_sandbox` gives :class:`~lightning_agentrl.distributed.NodeSandbox` (a named service, a fleet, or
the reference server that local rank 0 of each node starts in ``setup``) where the environment runs actions in
the service (``Environment.uses_sandbox``), and :class:`NoSandbox` where it does not. Both are Lightning
callbacks with the same methods, so ``fit``, ``evaluate`` and ``sft`` treat them alike.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lightning_agentrl.distributed import NodeSandbox
from lightning_agentrl.envs.registry import settings_env_class
from lightning_agentrl.settings import Settings


def env_uses_sandbox(settings: Settings) -> bool:
    """Whether ``env.kind``'s environment runs actions in the sandbox service (``Environment.uses_sandbox``)."""
    return settings_env_class(settings.env).uses_sandbox


def judge_policy(settings: Settings) -> str | None:
    """``sandbox.judge_isolation`` where ``env.kind``'s environment is scored by the service's judge; None
    (nothing to check) for environments that reward without it."""
    return settings.sandbox.judge_isolation if settings_env_class(settings.env).runs_hidden_tests else None


def harness_timeout(settings: Settings) -> float | None:
    """``env.episode_timeout_s`` where a harness runs in the sandbox (``env.agent_in_sandbox``), else None."""
    return settings.env.episode_timeout_s if settings.env.agent_in_sandbox else None


class NoSandbox(L.Callback):
    """Stands in for :class:`~lightning_agentrl.distributed.NodeSandbox` when the environment does not use the
    sandbox service (``Environment.uses_sandbox`` False): it starts and checks nothing; its client is None."""

    url = None
    uses_service = False

    def start(self, **_) -> None:
        return None

    def make_client(self, **_) -> None:
        return None

    def close(self) -> None:
        return None


def make_sandbox(settings: Settings, log_dir: Path) -> NodeSandbox | NoSandbox:
    """The node's sandbox service (started in ``setup`` when ``sandbox.url`` and ``urls`` are unset), or
    :class:`NoSandbox` when the environment uses none."""
    if not env_uses_sandbox(settings):
        return NoSandbox()
    s = settings.sandbox
    return NodeSandbox(s.url, s.token_value, timeout_s=s.request_timeout_s, max_retries=s.max_retries,
                       call_timeout_s=s.call_timeout_s, log_dir=log_dir, judge_isolation=judge_policy(settings),
                       tools_dir=s.tools_dir if settings.env.agent_in_sandbox else None,
                       episode_timeout_s=settings.env.episode_timeout_s, urls=s.urls)


__all__ = ["NoSandbox", "env_uses_sandbox", "harness_timeout", "judge_policy", "make_sandbox"]
