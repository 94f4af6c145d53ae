"""Score a submission with hidden tests, without letting the agent touch them.

The hidden tests never enter the agent's sandbox. Scoring builds a FRESH sandbox from the original
task snapshot, copies in the agent's changed or added source files (its own test files and
conftest.py are left behind, so it cannot weaken the hidden run), writes the hidden files on top,
and runs ``test_command`` with the scoring timeout: exit code 0 -> reward 1.0, else 0.0; a timeout
gives ``timeout_reward`` (decided up front; DeepSWE uses 0). The scoring sandbox is always deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import PurePosixPath

from sandbox_client.client import SandboxClient
from sandbox_client.errors import CommandTimeout, SandboxError, SandboxRequestError

log = logging.getLogger(__name__)
_CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache", ".git", ".mypy_cache", ".ruff_cache"})
_MAX_OUTPUT_CHARS = 20_000
_READ_CONCURRENCY = 16


@dataclass(frozen=True)
class ScoreResult:
    reward: float
    passed: bool
    timed_out: bool
    output: str
    carried_files: list[str] = field(default_factory=list)


def is_agent_test_file(path: str) -> bool:
    """Files the agent may have written to steer the hidden run: test modules, tests/ trees, conftest.py."""
    pure = PurePosixPath(path)
    name = pure.name
    return (
        name == "conftest.py"
        or (name.startswith("test_") and name.endswith(".py"))
        or name.endswith("_test.py")
        or "tests" in pure.parts[:-1]
    )


def _is_cache(path: str) -> bool:
    pure = PurePosixPath(path)
    return pure.suffix in (".pyc", ".pyo") or any(part in _CACHE_DIRS for part in pure.parts[:-1])


async def _changed_files(client: SandboxClient, sandbox_id: str, task_files: dict[str, str]) -> dict[str, str | bytes]:
    candidates = [p for p in await client.list_files(sandbox_id) if not _is_cache(p) and not is_agent_test_file(p)]
    gate = asyncio.Semaphore(_READ_CONCURRENCY)

    async def read(path: str) -> tuple[str, str | bytes | None]:
        async with gate:
            try:
                data = await client.read_bytes(sandbox_id, path)
            except SandboxRequestError as exc:  # vanished or too large: the hidden run goes without it
                log.warning("not carrying %s to scoring: %s", path, exc)
                return path, None
        try:
            return path, data.decode("utf-8")
        except UnicodeDecodeError:
            return path, data

    changed: dict[str, str | bytes] = {}
    for path, content in await asyncio.gather(*(read(p) for p in candidates)):
        if content is not None and task_files.get(path) != content:
            changed[path] = content
    return changed


async def score_submission(client: SandboxClient, *, task_files: dict[str, str], hidden_files: dict[str, str],
                           agent_sandbox_id: str, test_command: str, timeout_s: float,
                           timeout_reward: float = 0.0) -> ScoreResult:
    """Run the hidden tests on the agent's edits in a fresh sandbox; see the module docstring.

    Raises SandboxInfraError (or a subclass) when the service fails: the caller marks the trajectory
    ``sandbox_error`` rather than giving it a reward.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    changed = await _changed_files(client, agent_sandbox_id, task_files)
    carried = sorted(changed)
    scoring_id = await client.create({**task_files, **changed})
    try:
        for path, content in hidden_files.items():
            await client.write_file(scoring_id, path, content)
        try:
            result = await client.exec(scoring_id, test_command, timeout_s=timeout_s)
        except CommandTimeout as exc:
            output = _output(exc.result.stdout, exc.result.stderr)
            return ScoreResult(reward=timeout_reward, passed=False, timed_out=True, output=output,
                               carried_files=carried)
        passed = result.exit_code == 0
        return ScoreResult(reward=1.0 if passed else 0.0, passed=passed, timed_out=False,
                           output=_output(result.stdout, result.stderr), carried_files=carried)
    finally:
        # The server's TTL reaps it if this fails; do not let cleanup mask the score or the real error.
        with contextlib.suppress(SandboxError):
            await client.delete(scoring_id)


def _output(stdout: str, stderr: str) -> str:
    text = stdout + (("\n" + stderr) if stderr else "")
    return text if len(text) <= _MAX_OUTPUT_CHARS else "...\n" + text[-_MAX_OUTPUT_CHARS:]
