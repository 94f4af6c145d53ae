"""Score a submission with hidden tests, without letting the agent touch them or game them.

The hidden tests never enter the agent's sandbox, and the agent's code never runs in the process
that runs them. Scoring takes a snapshot of the agent's work: a fork of its sandbox where the
service supports fork (SPEC §6: the original is undisturbed), else a fresh sandbox of the task
snapshot plus the agent's changed source files. In it, one exec starts two processes
(``peer_command``, see docs/sandbox.md): the judge (``score_runner``), as a uid of its own, gets
the hidden files and a nonce on stdin, runs the tests and prints the only report line
(``SCORE-REPORT <nonce> {...}``); the peer (``score_peer``), as the sandbox's uid, imports the
agent's modules and answers the tests' calls with plain values over a pipe. The reward is 1.0 when
at least ``required_passed`` hidden tests passed and none failed or errored; else 0.0. The exit
code of the test command is never evidence; nothing the agent wrote (``pytest.ini``,
``conftest.py``, plugins, ``__init__.py``, ``sitecustomize.py``, hooks registered on import)
changes how the hidden tests are collected, run or counted.
A timeout gives ``timeout_reward`` (decided up front; DeepSWE uses 0). A workspace that cannot be
copied (over the disk quota, too many files) scores 0 with the reason in ``problems``: the agent
filled it. The scoring sandbox is always deleted.

Test commands understood (the task's ``hidden_test_command``): ``python -m pytest [flags] PATH...``
with every PATH a hidden file or folder, and ``python SCRIPT [args]`` with SCRIPT a hidden file
(its exit code is its one result).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shlex
import subprocess
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from sandbox_client.client import SandboxClient
from sandbox_client.errors import (
    CommandTimeout,
    SandboxCapacityError,
    SandboxError,
    SandboxInfraError,
    SandboxRequestError,
)
from sandbox_client.score_runner import REPORT_PREFIX

log = logging.getLogger(__name__)
_CACHE_DIRS = frozenset({"__pycache__", ".pytest_cache", ".git", ".mypy_cache", ".ruff_cache"})
_MAX_OUTPUT_CHARS = 20_000
_READ_CONCURRENCY = 16
_RUNNER_SOURCE = (Path(__file__).resolve().parent / "score_runner.py").read_text(encoding="utf-8")
_PEER_SOURCE = (Path(__file__).resolve().parent / "score_peer.py").read_text(encoding="utf-8")
JUDGE_ARGV = ["python", "-I", "-B", "-c", _RUNNER_SOURCE]
PEER_ARGV = ["python", "-I", "-B", "-c", _PEER_SOURCE]
# The runner stops the tests this long before the exec timeout, so a slow run still reports.
_RUNNER_MARGIN_S = 2.0


@dataclass(frozen=True)
class ScoreResult:
    reward: float
    passed: bool
    timed_out: bool
    output: str
    carried_files: list[str] = field(default_factory=list)
    num_passed: int = 0
    num_failed: int = 0
    snapshot: str = "fresh"  # "fork": a copy of the agent's sandbox; "fresh": task snapshot + changed files
    problems: list[str] = field(default_factory=list)  # why a run that passed tests still scored 0
    unscorable: bool = False  # the agent's workspace could not be snapshotted (too large, deep or slow): reward 0


@dataclass(frozen=True)
class HiddenCommand:
    """A task's hidden test command, parsed: pytest over hidden paths, or one hidden script.

    Every pytest argument not starting with ``-`` must name a hidden file or folder; give option
    values joined (``-kname``, ``--maxfail=1``), not as separate words."""

    kind: str  # "pytest" | "script"
    args: list[str]  # pytest flags and hidden paths, or [script, *script_args]

    @classmethod
    def parse(cls, command: str, hidden_files: dict[str, str] | list[str]) -> HiddenCommand:
        argv = shlex.split(command)
        if not argv or argv[0] not in ("python", "python3"):
            raise ValueError(f"hidden test command must start with python, got {command!r}")
        hidden = list(hidden_files)
        if argv[1:3] == ["-m", "pytest"]:
            args = argv[3:]
            paths = [a for a in args if not a.startswith("-")]
            if not paths:
                raise ValueError(f"hidden test command {command!r} names no hidden test path")
            for path in paths:
                if not _is_hidden_path(path, hidden):
                    raise ValueError(f"hidden test command {command!r}: {path!r} is not a hidden file or folder")
            return cls("pytest", args)
        if len(argv) >= 2 and not argv[1].startswith("-") and argv[1] in hidden:
            return cls("script", argv[1:])
        raise ValueError(f"hidden test command {command!r}: expected 'python -m pytest [flags] HIDDEN_PATH...' "
                         "or 'python HIDDEN_SCRIPT [args]'")

    def payload(self, hidden_files: dict[str, str], nonce: str, timeout_s: float,
                fds: tuple[int, int, int] = (3, 4, 5)) -> str:
        """The judge's stdin: one JSON line (the hidden files travel here, never through the workspace)."""
        return json.dumps({"nonce": nonce, "files": hidden_files, "kind": self.kind, "args": self.args,
                           "timeout_s": timeout_s, "fds": list(fds)}) + "\n"


def _is_hidden_path(path: str, hidden: list[str]) -> bool:
    path = path.strip("/")
    return any(h == path or h.startswith(path + "/") for h in hidden)


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
                           timeout_reward: float = 0.0, required_passed: int | None = None,
                           snapshot: str = "auto") -> ScoreResult:
    """Run the hidden tests on a snapshot of the agent's work; see the module docstring.

    ``required_passed``: hidden tests that must pass (the task's ``hidden_test_count``; None: at
    least one). ``snapshot``: "fork", "fresh" or "auto" (fork, else fresh when the service has no fork or the
    server holding the agent's sandbox is full).
    Raises SandboxInfraError (or a subclass) when the service fails: the caller marks the trajectory
    ``sandbox_error`` rather than giving it a reward.
    """
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be positive, got {timeout_s}")
    if snapshot not in ("auto", "fork", "fresh"):
        raise ValueError(f"snapshot must be auto, fork or fresh, got {snapshot!r}")
    if required_passed is not None and required_passed < 1:
        raise ValueError(f"required_passed must be >= 1, got {required_passed}")
    command = HiddenCommand.parse(test_command, hidden_files)
    scoring_id, carried, used = await _snapshot(client, agent_sandbox_id, task_files, snapshot)
    if scoring_id is None:  # the agent's workspace cannot be copied (too many files, too deep): its doing
        return ScoreResult(reward=0.0, passed=False, timed_out=False, output=carried[0], snapshot=used,
                           problems=["workspace could not be snapshotted"], unscorable=True)
    try:
        nonce = secrets.token_hex(16)
        runner_timeout = max(timeout_s - _RUNNER_MARGIN_S, timeout_s / 2)
        try:
            # the judge writes before it reads: the peer can wait for its first request
            result = await client.exec(scoring_id, JUDGE_ARGV, peer_command=PEER_ARGV, lazy_peer=True,
                                       stdin=command.payload(hidden_files, nonce, runner_timeout), timeout_s=timeout_s)
        except CommandTimeout as exc:
            output = _output(exc.result.stdout, exc.result.stderr)
            return ScoreResult(reward=timeout_reward, passed=False, timed_out=True, output=output,
                               carried_files=carried, snapshot=used)
        return _judge(result.stdout, result.stderr, nonce, required_passed, timeout_reward, carried, used)
    finally:
        # The server's TTL reaps it if this fails; do not let cleanup mask the score or the real error.
        with contextlib.suppress(SandboxError):
            await client.delete(scoring_id)


async def _snapshot(client: SandboxClient, agent_sandbox_id: str, task_files: dict[str, str],
                    snapshot: str) -> tuple[str | None, list[str], str]:
    """(scoring sandbox id, carried files, "fork" | "fresh"); id None with a message when refused."""
    if snapshot in ("auto", "fork"):
        try:
            return await client.fork(agent_sandbox_id), [], "fork"
        except SandboxRequestError as exc:
            no_fork = exc.status in (404, 405, 501) and exc.code != "sandbox_not_found"
            if snapshot == "fork" or not no_fork:
                return None, [f"fork of the agent's sandbox refused: {exc}"], "fork"
        except SandboxCapacityError:  # its server is full; a fresh copy may go to another (a fleet's placement)
            if snapshot == "fork":
                raise
    try:
        changed = await _changed_files(client, agent_sandbox_id, task_files)
    except SandboxRequestError as exc:  # too many files or too deep a tree to list: the agent's doing
        return None, [f"the agent's files could not be listed for a fresh sandbox: {exc}"], "fresh"
    try:
        return await client.create({**task_files, **changed}), sorted(changed), "fresh"
    except SandboxRequestError as exc:  # the agent's files do not fit a sandbox (over the disk quota, too big)
        return None, [f"a fresh sandbox of the agent's files was refused: {exc}"], "fresh"


def _judge(stdout: str, stderr: str, nonce: str, required_passed: int | None, timeout_reward: float,
           carried: list[str], used: str) -> ScoreResult:
    report = parse_report(stdout, nonce)
    if report is None:
        return ScoreResult(reward=0.0, passed=False, timed_out=False, output=_output(stdout, stderr),
                           carried_files=carried, snapshot=used, problems=["no single runner report in the output"])
    if report.get("infra_error"):  # the service could not give the judge its peer: not the agent's doing
        raise SandboxInfraError(f"scoring could not run: {report['infra_error']}")
    output = _output(report.get("output", ""), stderr)
    passed, failed = report["passed"], report["failed"]
    if report["timed_out"]:
        return ScoreResult(reward=timeout_reward, passed=False, timed_out=True, output=output,
                           carried_files=carried, num_passed=len(passed), num_failed=len(failed), snapshot=used)
    problems = report_problems(report, required_passed)
    ok = not problems
    return ScoreResult(reward=1.0 if ok else 0.0, passed=ok, timed_out=False, output=output, carried_files=carried,
                       num_passed=len(passed), num_failed=len(failed), snapshot=used, problems=problems)


def run_locally(workdir: str, hidden_files: dict[str, str], command: HiddenCommand, python: str,
                timeout_s: float, env: dict[str, str]) -> tuple[dict | None, subprocess.CompletedProcess | None]:
    """Judge and peer as plain local subprocesses of one uid (task validation; no server, no uid
    boundary): (the report or None, the judge's completed process or None on a timeout)."""
    nonce = secrets.token_hex(8)
    to_peer_r, to_peer_w = os.pipe()
    from_peer_r, from_peer_w = os.pipe()
    err_r, err_w = os.pipe()
    judge_fds = (to_peer_w, from_peer_r, err_r)
    try:
        peer = subprocess.Popen([python, *PEER_ARGV[1:]], cwd=workdir, env=env, stdin=to_peer_r, stdout=from_peer_w,
                                stderr=err_w, start_new_session=True)
    finally:
        for fd in (to_peer_r, from_peer_w, err_w):
            os.close(fd)
    try:
        completed = subprocess.run([python, *JUDGE_ARGV[1:]], cwd=workdir, env=env, pass_fds=judge_fds,
                                   input=command.payload(hidden_files, nonce, timeout_s, judge_fds),
                                   capture_output=True, text=True, timeout=timeout_s + 30, check=False)
    except subprocess.TimeoutExpired:
        return None, None
    finally:
        for fd in judge_fds:
            os.close(fd)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(peer.pid, 9)
        peer.wait()
    return parse_report(completed.stdout, nonce), completed


def parse_report(stdout: str, nonce: str) -> dict | None:
    """The runner's report from its stdout: exactly one line with this nonce, else None."""
    lines = [line for line in stdout.splitlines() if line.startswith(f"{REPORT_PREFIX} {nonce} ")]
    if len(lines) != 1:
        return None
    try:
        report = json.loads(lines[0].split(" ", 2)[2])
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def report_problems(report: dict, required_passed: int | None) -> list[str]:
    """Why a runner report (see ``score_runner``) does not earn the reward; [] when it does."""
    passed, failed = report["passed"], report["failed"]
    need = required_passed or 1
    problems = []
    if len(passed) < need:
        problems.append(f"{len(passed)} hidden tests passed, {need} required")
    if failed:
        problems.append(f"{len(failed)} hidden tests failed: {', '.join(failed[:5])}")
    if report["errors"]:
        problems.append(f"collection errors: {', '.join(report['errors'][:5])}")
    if not report["finished"] or report["worker_exitstatus"] != 0:
        problems.append(f"the test run did not finish cleanly (exit {report['exit_code']})")
    return problems


def _output(stdout: str, stderr: str) -> str:
    text = stdout + (("\n" + stderr) if stderr else "")
    return text if len(text) <= _MAX_OUTPUT_CHARS else "...\n" + text[-_MAX_OUTPUT_CHARS:]
