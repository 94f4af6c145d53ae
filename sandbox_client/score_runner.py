"""The hidden-test runner that scoring copies into the scoring sandbox: standard library only.

Why it exists: a test command's exit code is not evidence. The agent's code runs inside the test
process, and an exit code of 0 comes from ``os._exit(0)`` on import as easily as from passing tests;
a ``pytest.ini``, ``conftest.py``, ``__init__.py`` or plugin the agent left in its workspace can
change how tests are collected and reported. So the reward comes from a count of passed hidden
tests in a report that only this runner writes.

Two processes, both started with ``python -I -B``: isolated mode ignores every ``PYTHON*``
variable, user site-packages and the script's and working directory on ``sys.path`` (so no
``sitecustomize.py``/``usercustomize.py`` of the agent's runs); no bytecode is written. (A
``__pycache__`` file the agent left for its own module is code it wrote, like the module itself;
ignoring all caches with ``-X pycache_prefix`` would recompile pytest on every run, +1.2 s.)

- The *supervisor* (``python -I score_runner.py --nonce-from-stdin ...``) never imports anything of
  the agent's. It reads a nonce from stdin, makes itself non-dumpable (its memory and file
  descriptors are closed to processes of the same uid), starts the worker in a new session with its
  own output file and results file, waits (killing the worker's whole process group at the end or
  at the deadline), counts the results and prints the only report line on its stdout:
  ``SCORE-REPORT <nonce> <json>``. The worker never holds the supervisor's stdout.
- The *worker* runs pytest in-process with: ``-c`` an empty ini file the scorer wrote (the agent's
  ``pytest.ini``/``pyproject.toml``/``setup.cfg``/``tox.ini`` are never read), ``--rootdir`` and
  ``--confcutdir`` at the hidden-test folder (no ``conftest.py`` of the agent's is loaded), plugin
  autoload off and ``PYTEST_*`` variables cleared (no entry-point or ``-p`` plugins), no cache
  provider. The workspace joins ``sys.path`` only once the session starts. A recorder plugin writes
  one line per test outcome to the results file and checks that no function or class of pytest,
  pluggy, ``builtins``, ``os`` or ``json`` was replaced meanwhile, and that each test still runs the code it was
  collected with (both reported as ``tampered``).
- ``--script`` mode runs one hidden script (``python -I SCRIPT``) in the workspace instead; its exit
  code is its one result, decided by the supervisor.

What it cannot do: the agent's module executes in the worker, with the worker's uid. Code written
for this runner (forging result lines, rewriting a hidden test file before pytest reads it, undoing
its patches before the end) can still win; the checks above close the generic tricks a policy finds
by trial. docs/sandbox.md lists what is and is not covered.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

REPORT_PREFIX = "SCORE-REPORT"
# Bound before any of the agent's code can run: patching json.dumps or os.write later changes nothing here.
_dumps, _write = json.dumps, os.write
_OUTPUT_TAIL_BYTES = 16_000
_PR_SET_DUMPABLE = 4


# ---- worker: pytest in-process, results as JSON lines on an inherited fd --------------------------
def _public_callables() -> dict[tuple[str, str], int]:
    """id() of every function and class (and class attribute) of pytest, pluggy and builtins."""
    import builtins

    snapshot: dict[tuple[str, str], int] = {}
    modules = {"builtins": builtins, "os": os, "json": json}
    modules.update((name, mod) for name, mod in list(sys.modules.items())
                   if mod is not None and name.split(".")[0] in ("_pytest", "pytest", "pluggy"))
    for mod_name, module in modules.items():
        for name, value in list(vars(module).items()):
            if isinstance(value, type) or callable(value):
                snapshot[(mod_name, name)] = id(value)
            if isinstance(value, type) and value.__module__ == getattr(module, "__name__", None):
                for attr, member in list(vars(value).items()):
                    if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                        snapshot[(mod_name, f"{name}.{attr}")] = id(member)
    return snapshot


class _Recorder:
    """pytest plugin: one JSON line per test phase result, written with os.write to ``fd``."""

    def __init__(self, fd: int, workspace: str) -> None:
        self.fd = fd
        self.workspace = workspace
        self.before: dict[tuple[str, str], int] = {}
        self.code: dict[str, object] = {}  # nodeid -> the test function's code object at collection
        self.replaced: list[str] = []

    def _emit(self, record: dict) -> None:
        _write(self.fd, (_dumps(record) + "\n").encode())

    def pytest_configure(self, config) -> None:
        self.before = _public_callables()

    def pytest_sessionstart(self, session) -> None:
        # Only now, with pytest configured and the snapshot taken, may the agent's modules be found.
        sys.path.insert(0, self.workspace)

    def pytest_collection_finish(self, session) -> None:
        for item in session.items:
            self.code[item.nodeid] = getattr(getattr(item, "obj", None), "__code__", None)

    def pytest_runtest_call(self, item) -> None:
        # A test whose code object was swapped after collection (``f.__code__ = ...``) is not the test.
        if getattr(getattr(item, "obj", None), "__code__", None) is not self.code.get(item.nodeid):
            self.replaced.append(item.nodeid)

    def pytest_collectreport(self, report) -> None:
        if report.failed:
            self._emit({"event": "collect_error", "nodeid": report.nodeid})

    def pytest_runtest_logreport(self, report) -> None:
        self._emit({"event": "phase", "nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                    "xfail": hasattr(report, "wasxfail")})

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        after = _public_callables()
        changed = sorted(f"{mod}.{name}" for key, value in self.before.items()
                         if after.get(key, value) != value for mod, name in [key])
        changed += [f"code of {nodeid}" for nodeid in self.replaced]
        self._emit({"event": "finish", "exitstatus": int(exitstatus), "tampered": changed[:50]})


def _worker(results_fd: int, workspace: str, root: str, pytest_args: list[str]) -> int:
    for name in list(os.environ):
        if name.startswith("PYTEST_") or name.startswith("PY_COLORS"):
            del os.environ[name]
    os.environ["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    import pytest  # before the workspace is on sys.path: the agent cannot shadow it

    ini = os.path.join(root, "pytest.ini")
    args = ["-c", ini, "--rootdir", root, "--confcutdir", root, "-p", "no:cacheprovider",
            "-p", "no:stepwise", *pytest_args]
    return int(pytest.main(args, plugins=[_Recorder(results_fd, workspace)]))


# ---- supervisor ----------------------------------------------------------------------------------
def _count(results_path: str, script_exit: int | None) -> dict:
    if script_exit is not None:
        passed = ["script"] if script_exit == 0 else []
        return {"passed": passed, "failed": [] if passed else ["script"], "errors": [], "tampered": [],
                "worker_exitstatus": script_exit, "finished": True}
    phases: dict[str, list[dict]] = {}
    errors: list[str] = []
    finish: dict | None = None
    with open(results_path, "rb") as f:
        for line in f.read().splitlines():
            try:
                record = json.loads(line)
            except ValueError:
                errors.append("unreadable result line")
                continue
            if not isinstance(record, dict):
                errors.append("unreadable result line")
            elif record.get("event") == "phase":
                phases.setdefault(str(record.get("nodeid")), []).append(record)
            elif record.get("event") == "collect_error":
                errors.append(str(record.get("nodeid")))
            elif record.get("event") == "finish":
                finish = record
    passed, failed = [], []
    for nodeid, records in phases.items():
        by_phase = {r.get("when"): r for r in records}
        ok = (by_phase.get("call", {}).get("outcome") == "passed" and not by_phase["call"].get("xfail")
              and all(r.get("outcome") == "passed" for r in records) and len(records) == len(by_phase))
        (passed if ok else failed).append(nodeid)
    return {"passed": sorted(passed), "failed": sorted(failed), "errors": errors,
            "tampered": list(finish.get("tampered", [])) if finish else [],
            "worker_exitstatus": finish.get("exitstatus") if finish else None, "finished": finish is not None}


def _python_flags() -> list[str]:
    return [sys.executable, "-I", "-B"]


def _supervise(args: argparse.Namespace) -> int:
    nonce = sys.stdin.readline().strip()
    if _libc := _load_libc():
        _libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)
    workspace = os.getcwd()
    private_dir = tempfile.mkdtemp(prefix="score-")
    os.chmod(private_dir, 0o700)
    results_path = os.path.join(private_dir, "results.jsonl")
    output_path = os.path.join(private_dir, "output.txt")
    results_fd = os.open(results_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    if args.script:
        argv = [*_python_flags(), args.script, *args.rest]
        pass_fds: tuple[int, ...] = ()
    else:
        argv = [*_python_flags(), os.path.abspath(__file__), "--worker", str(results_fd),
                "--root", args.root, "--", *args.rest]
        pass_fds = (results_fd,)
    start = time.monotonic()
    timed_out = False
    with open(output_path, "wb") as output:
        worker = subprocess.Popen(argv, cwd=workspace, stdin=subprocess.DEVNULL, stdout=output,
                                  stderr=subprocess.STDOUT, pass_fds=pass_fds, start_new_session=True)
        try:
            exit_code = worker.wait(timeout=args.timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            exit_code = -signal.SIGKILL
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)  # daemons it left behind too
        worker.wait()
    os.close(results_fd)
    report = _count(results_path, exit_code if args.script else None)
    report.update(exit_code=exit_code, timed_out=timed_out, duration_s=round(time.monotonic() - start, 3),
                  output=_tail(output_path))
    sys.stdout.write(f"{REPORT_PREFIX} {nonce} {json.dumps(report)}\n")
    sys.stdout.flush()
    return 0


def _tail(path: str) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - _OUTPUT_TAIL_BYTES))
        return f.read().decode("utf-8", errors="replace")


def _load_libc():
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="hidden-test runner (see the module docstring)")
    parser.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", required=True, help="folder holding the hidden files and pytest.ini")
    parser.add_argument("--script", default=None, help="run this hidden script instead of pytest")
    parser.add_argument("--timeout-s", type=float, default=60.0)
    parser.add_argument("rest", nargs="*", help="pytest arguments (or the script's) after --")
    args = parser.parse_args(argv)
    if args.worker is not None:
        return _worker(args.worker, os.getcwd(), args.root, args.rest)
    return _supervise(args)


if __name__ == "__main__":
    sys.exit(main())
