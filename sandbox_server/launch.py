"""Start the reference sandbox service as a subprocess on loopback (for the trainer and the tests).

    with start_local_server(max_sandboxes=16) as server:
        async with SandboxClient(server.url, server.token) as client:
            ...
"""

from __future__ import annotations

import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx2
from pydantic import ValidationError

from sandbox_server.__main__ import ENV_PREFIX, TOKEN_ENV
from sandbox_server.options import ServerOptions, describe

_REPO_ROOT = Path(__file__).resolve().parent.parent


def die_with_parent() -> None:
    """In the child, before exec (``preexec_fn``): get SIGTERM when the parent dies, even by SIGKILL
    (Linux), so a killed trainer never leaves a server (and its sandboxes) behind. Elsewhere: a no-op."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on now (the OS's pick), for a server about to start on ``host``."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class LocalSandboxServer:
    """A running ``python -m sandbox_server`` subprocess. Use as a context manager; always stops on exit."""

    def __init__(self, *, host: str, port: int, token: str, startup_timeout_s: float = 30.0,
                 log_file: str | os.PathLike | None = None, **server_options: object) -> None:
        known = set(ServerOptions.field_names()) - {"token"}
        unknown = set(server_options) - known
        if unknown:
            raise ValueError(f"unknown sandbox server options {sorted(unknown)}; known: {sorted(known)}")
        try:  # validate here, with a Python traceback
            ServerOptions(token=token, **server_options)
        except ValidationError as exc:
            raise ValueError(f"invalid sandbox server options: {describe(exc)}") from None
        self.host = host
        self.port = port or free_port(host)
        self.token = token
        self.url = f"http://{host}:{self.port}"
        argv = [sys.executable, "-m", "sandbox_server", "--host", host, "--port", str(self.port),
                "--log-level", "warning"]
        for name, value in server_options.items():
            flag = name.replace("_", "-")
            argv += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
        # Only the options passed here configure the server: a caller's SANDBOX_SERVER_* variables (meant
        # for a server they start themselves) must not change it silently (e.g. allow root commands).
        env = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)} | {TOKEN_ENV: token}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO_ROOT), env.get("PYTHONPATH", "")]))
        self._log_path = log_file
        # A file, never a pipe: nobody drains a pipe during a long run, and a full pipe blocks the server.
        self._log = open(log_file, "ab") if log_file else tempfile.TemporaryFile()  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(argv, env=env, stdout=self._log, stderr=self._log,
                                        preexec_fn=die_with_parent)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        headers = {"Authorization": f"Bearer {self.token}"}
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self._read_log()
                raise RuntimeError(f"sandbox server exited with code {self.process.returncode}: {err[-2000:]}")
            try:
                if httpx2.get(f"{self.url}/v1/health", headers=headers, timeout=1.0).status_code == 200:
                    return
            except httpx2.HTTPError:
                pass
            time.sleep(0.05)
        raise TimeoutError(f"sandbox server at {self.url} not healthy after {timeout_s} s")

    def _read_log(self) -> str:
        if self._log is None:
            return ""
        self._log.flush()
        if self._log_path is not None:
            return Path(self._log_path).read_bytes().decode(errors="replace")
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def health(self) -> dict:
        response = httpx2.get(f"{self.url}/v1/health", headers={"Authorization": f"Bearer {self.token}"})
        response.raise_for_status()
        return response.json()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (graceful: sandboxes are removed), then kill if it does not exit in time."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> LocalSandboxServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:  # never shows the token
        return f"LocalSandboxServer(url={self.url!r}, pid={self.process.pid})"


def start_local_server(*, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                       **server_options: object) -> LocalSandboxServer:
    """Start ``python -m sandbox_server`` on a free port (``port=0``) with a random token unless given,
    wait until /v1/health answers, and return the handle (``.url``, ``.token``, ``.stop()``)."""
    return LocalSandboxServer(host=host, port=port, token=token or secrets.token_urlsafe(32), **server_options)
