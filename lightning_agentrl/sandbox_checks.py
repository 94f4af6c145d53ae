"""What a run needs of the sandbox service: whether its environment uses one at all, and what the service's
health answer must say (a judge isolated from the agent; what a harness run in the sandbox needs). Checked at
start-up for a service the settings name (``preflight.py``) and for the one a run starts itself
(:class:`~lightning_agentrl.distributed.NodeSandbox`). Light on purpose: ``validate`` imports it, not torch.
"""

from __future__ import annotations

import warnings

from lightning_agentrl.envs.registry import settings_env_class
from lightning_agentrl.settings import PreflightError, Settings


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


def check_harness_support(health: dict, *, where: str, episode_timeout_s: float) -> None:
    """The service's health answer says it forwards a gateway URL into its sandboxes, mounts a tools folder
    (``gateway``, ``tools``) and takes commands as long as an episode: what ``env.agent_in_sandbox`` needs;
    else a :class:`PreflightError`."""
    health = health if isinstance(health, dict) else {}
    missing = [what for key, what in (("gateway", "bwrap isolation, so that a command reaches its gateway URL and "
                                       "nothing else"), ("tools", "a tools folder mounted at /tools (--tools-dir)"))
               if health.get(key) is not True]
    if missing:
        raise PreflightError(f"env.agent_in_sandbox: {where} cannot run a harness in its sandboxes: it lacks "
                             + " and ".join(missing))
    limits = health.get("limits") if isinstance(health.get("limits"), dict) else {}
    longest = limits.get("max_timeout_s")
    if isinstance(longest, int | float) and longest < episode_timeout_s:
        raise PreflightError(f"env.episode_timeout_s: {where} runs a command for at most {longest:g} s "
                             f"(max_timeout_s), less than an episode's {episode_timeout_s:g} s")


def check_judge_isolation(health: dict, policy: str | None, *, where: str) -> bool:
    """Whether the service's health answer says how each sandbox's judge runs under its own uid
    (``isolation.enforced.judge_uid_per_sandbox``, a non-empty string); when it does not (null, another
    type, a health answer of another shape), a :class:`PreflightError` naming
    ``sandbox.judge_isolation`` with ``policy="require"``, a warning with ``"warn"``; ``None``: no check."""
    if policy is None:
        return True
    isolation = health.get("isolation") if isinstance(health, dict) else None
    enforced = isolation.get("enforced") if isinstance(isolation, dict) else None
    how = enforced.get("judge_uid_per_sandbox") if isinstance(enforced, dict) else None
    if isinstance(how, str) and how.strip():  # the service says how, e.g. "uids 100256..100511 ..."
        return True
    message = (f"{where} runs the judge that holds the hidden tests under the agent's own uid (not run as root), "
               "so an agent can read the tests and be rewarded without solving the task (docs/sandbox.md, "
               "single-uid mode)")
    if policy == "require":
        raise PreflightError(f"sandbox.judge_isolation: {message}; run the service as root, or set "
                             "sandbox.judge_isolation=warn to train anyway")
    warnings.warn(f"sandbox.judge_isolation=warn: {message}", stacklevel=2)
    return False


__all__ = ["check_harness_support", "check_judge_isolation", "env_uses_sandbox", "harness_timeout", "judge_policy"]
