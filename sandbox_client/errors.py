"""Error taxonomy. The trainer maps each class to one outcome (SPEC §4):

- :class:`SandboxInfraError`: the environment failed (lost sandbox, unreachable server, 5xx after
  retries, server full after retries, bad credentials). The trajectory ends as ``sandbox_error`` and
  is excluded from training.
- :class:`CommandTimeout`: the command ran past its timeout and its process tree was killed; it carries
  the partial :class:`ExecResult`. The trajectory ends as ``timeout``.
- :class:`SandboxRequestError`: the server refused what the agent asked for (path traversal, missing
  file, payload too big). The environment turns it into an error observation.

A command that exits non-zero is not an error: it is an ExecResult with ``exit_code != 0``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sandbox_client.models import ExecResult


class SandboxError(Exception):
    """Base class of every error this client raises. ``status`` and ``code`` come from the server when known."""

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code


class SandboxInfraError(SandboxError):
    """Infrastructure fault: not the agent's doing; exclude the trajectory from training."""


class SandboxUnreachable(SandboxInfraError):
    """The server did not answer within the call's deadlines (refused or reset connections, timeouts): it is
    down or cut off. A fleet client stops placing sandboxes on it until its health call answers again."""


class SandboxNotFound(SandboxInfraError):
    """The sandbox does not exist (any more): deleted, reaped after its TTL, or lost in a server restart."""


class SandboxCapacityError(SandboxInfraError):
    """The service stayed full (429) through every retry. ``retry_after_s``: its last ``Retry-After``."""

    retry_after_s: float = 1.0


class SandboxAnswerDropped(SandboxInfraError):
    """A retried request (its first answer was lost in transit) ran once, but the service no longer
    keeps its answer (410 ``answer_dropped``: the answer budget was full); it was not run again."""


class SandboxAuthError(SandboxInfraError):
    """The token was refused (401/403): a configuration fault."""


class CommandTimeout(SandboxError):
    """``exec`` ran past its timeout; the process tree was killed. ``result`` holds the partial output."""

    def __init__(self, message: str, result: ExecResult) -> None:
        super().__init__(message, code="timeout")
        self.result = result


class SandboxRequestError(SandboxError):
    """The server refused a request the agent caused (bad path, missing file, too big): show it to the agent."""


def error_for(status: int, code: str | None, text: str) -> SandboxError:
    """The error class of a service's refusal (HTTP ``status`` and the body's ``code``), per the taxonomy above."""
    if status in (401, 403):
        return SandboxAuthError(text, status=status, code=code)
    if status == 404 and code in ("sandbox_not_found", None):
        return SandboxNotFound(text, status=status, code=code)
    if status == 410 and code == "answer_dropped":
        return SandboxAnswerDropped(text, status=status, code=code)
    if status == 429:
        return SandboxCapacityError(text, status=status, code=code)
    if status >= 500 or code == "idempotency_key_reused":  # this client's keys are fresh per call: not the agent's doing
        return SandboxInfraError(text, status=status, code=code)
    return SandboxRequestError(text, status=status, code=code)
