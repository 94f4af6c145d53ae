"""Helpers of the fault tests (tests/test_fail_*.py): the CLI in a subprocess, its one error line, a short ``fit``
on the bugfix fixture, a loopback HTTP server."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens there


def cli(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "lightning_agentrl", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    return done, time.monotonic() - start


def error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


def serve(handler) -> tuple:
    """A threaded HTTP server on loopback answering with ``handler``: (server, base URL)."""
    import threading
    from http.server import ThreadingHTTPServer

    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


SMALL = ["--engine.max_new_tokens=24", "--env.max_turns=2", "--trainer.threads=1"]


def start_fit(run_dir: Path, *args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    return subprocess.Popen(
        [sys.executable, "-m", "lightning_agentrl", "fit", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--run.dir={run_dir}",
         *SMALL, *args],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def wait_for(path: Path, process: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert path.exists(), f"{path} never appeared: {process.poll()}"


def summary_step(run_dir: Path) -> int:
    import json

    return json.loads((run_dir / "summary.json").read_text())["global_step"]
