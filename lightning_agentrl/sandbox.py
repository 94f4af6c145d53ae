"""The object that stands for the run's sandbox service (whether the environment uses one: ``sandbox_checks.py``).

:func:`make_sandbox` gives :class:`~lightning_agentrl.distributed.NodeSandbox` (a named service, a fleet, or
the reference server that local rank 0 of each node starts in ``setup``) where the environment runs actions in
the service (``Environment.uses_sandbox``), and :class:`NoSandbox` where it does not. Both are Lightning
callbacks with the same methods, so ``fit``, ``evaluate`` and ``sft`` treat them alike.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L

from lightning_agentrl.distributed import NodeSandbox
from lightning_agentrl.sandbox_checks import env_uses_sandbox, judge_policy
from lightning_agentrl.settings import Settings


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


__all__ = ["NoSandbox", "make_sandbox"]
