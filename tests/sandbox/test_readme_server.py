"""The conformance suite against a server started exactly as the README starts one: default options,
the token in SANDBOX_SERVER_TOKEN, ``python -m sandbox_server --host 127.0.0.1 --port PORT``. The
suite's own fixture passes smaller limits; a default that breaks a guarantee (one file stopped by
RLIMIT_FSIZE below the disk quota left the disk half empty) shows only here."""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2

from sandbox_server.__main__ import ENV_PREFIX, TOKEN_ENV
from sandbox_server.launch import die_with_parent, free_port

REPO = Path(__file__).resolve().parents[2]


def test_the_conformance_suite_passes_against_a_server_started_as_the_readme_says():
    # a token may begin with "-" (token_urlsafe does, 1 time in 64): the "=" form keeps it a value
    token, port = "-" + secrets.token_urlsafe(32), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | {TOKEN_ENV: token}
    with tempfile.TemporaryFile() as log:
        server = subprocess.Popen([sys.executable, "-m", "sandbox_server", "--host", "127.0.0.1", "--port", str(port)],
                                  env=env, cwd=REPO, stdout=log, stderr=log, preexec_fn=die_with_parent)
        try:
            _wait_healthy(server, f"http://127.0.0.1:{port}", token)
            suite = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                                    "tests/sandbox_conformance", "--sandbox-url", f"http://127.0.0.1:{port}",
                                    f"--sandbox-token={token}"], cwd=REPO, capture_output=True, text=True, timeout=900)
        finally:
            server.terminate()
            server.wait(timeout=30)
    lines = suite.stdout.strip().splitlines()  # empty when the suite's process died (its exit status says how)
    summary = lines[-1] if lines else ""
    assert suite.returncode == 0 and " passed" in summary and "failed" not in summary, (
        f"exit status {suite.returncode}\n{suite.stdout[-6000:]}\n{suite.stderr[-3000:]}")


def _wait_healthy(server: subprocess.Popen, url: str, token: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert server.poll() is None, f"the server exited with code {server.returncode}"
        try:
            if httpx2.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {token}"}, timeout=1).is_success:
                return
        except httpx2.HTTPError:
            pass
        time.sleep(0.1)
    raise TimeoutError(f"the server at {url} was not healthy within {timeout_s} s")
