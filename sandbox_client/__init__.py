"""Async client of the sandbox service (protocol v1) and of a fleet of them, its error taxonomy and submission
scoring."""

from sandbox_client.client import SandboxClient
from sandbox_client.errors import (
    CommandTimeout,
    SandboxAnswerDropped,
    SandboxAuthError,
    SandboxCapacityError,
    SandboxError,
    SandboxInfraError,
    SandboxNotFound,
    SandboxRequestError,
    SandboxUnreachable,
)
from sandbox_client.fleet import SandboxFleet
from sandbox_client.models import ExecResult
from sandbox_client.scoring import ScoreResult, score_submission

__all__ = [
    "CommandTimeout",
    "SandboxAnswerDropped",
    "ExecResult",
    "SandboxAuthError",
    "SandboxCapacityError",
    "SandboxClient",
    "SandboxError",
    "SandboxFleet",
    "SandboxInfraError",
    "SandboxNotFound",
    "SandboxRequestError",
    "SandboxUnreachable",
    "ScoreResult",
    "score_submission",
]
