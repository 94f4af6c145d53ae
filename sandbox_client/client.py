"""Async client of the sandbox protocol v1 (docs/sandbox.md).

Every call retries connection errors, timeouts, 5xx and 429 (honouring Retry-After) with exponential
backoff and jitter, within two deadlines: ``timeout_s`` per attempt and ``call_timeout_s`` for the
whole call, retries included (a command's own timeout comes on top of both). The second bounds what
a frozen service (it accepts connections and never answers) costs: without it, every attempt waits
its full ``timeout_s``, i.e. ``(max_retries + 1) x timeout_s`` per call.

Calls that are not naturally idempotent (create, fork, exec) carry an idempotency key that stays
the same across retries; the server answers a repeated key with the first result, so a retried
exec never runs the command twice.

    async with SandboxClient(url, token) as client:
        sandbox_id = await client.create({"utils.py": "def f(): ..."})
        result = await client.exec(sandbox_id, "python -m pytest -q", timeout_s=60)
        await client.delete(sandbox_id)
"""

from __future__ import annotations

import asyncio
import base64
import random
import time
import uuid
from typing import Any

import httpx2

from sandbox_client.errors import (
    CommandTimeout,
    SandboxCapacityError,
    SandboxError,
    SandboxInfraError,
    SandboxRequestError,
    SandboxUnreachable,
    error_for,
)
from sandbox_client.models import ExecResult

PROTOCOL_VERSION = "v1"  # what /v1/health's ``protocol`` must say
_MAX_RETRY_AFTER_S = 30.0
_FORK_MARGIN_S = 2.0  # of an attempt's time, left for a refused fork's answer to arrive


class SandboxClient:
    """Client for one sandbox service. Use as an async context manager (or call :meth:`close`)."""

    def __init__(self, base_url: str, token: str, *, timeout_s: float = 30.0, max_retries: int = 4,
                 call_timeout_s: float | None = None, backoff_s: float = 0.25, max_backoff_s: float = 8.0,
                 max_connections: int = 64, transport: httpx2.AsyncBaseTransport | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        if call_timeout_s is not None and call_timeout_s < timeout_s:
            raise ValueError(f"call_timeout_s ({call_timeout_s}) must be >= timeout_s ({timeout_s}), or None")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        if backoff_s < 0 or max_backoff_s < 0:
            raise ValueError("backoff_s and max_backoff_s must be >= 0")
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {max_connections}")
        if not token:
            raise ValueError("token is empty")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.call_timeout_s = call_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._http = httpx2.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx2.Timeout(timeout_s),
            limits=httpx2.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    def __repr__(self) -> str:  # never shows the token
        return f"SandboxClient({self.base_url!r})"

    async def __aenter__(self) -> SandboxClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._http.aclose()

    # ---- transport with retries -----------------------------------------------------------------
    def _backoff(self, attempt: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * (2**attempt)) * random.uniform(0.5, 1.5)

    async def _request(self, method: str, path: str, *, json: Any = None, params: dict | None = None,
                       extra_s: float = 0.0, retry_full: bool = True) -> tuple[httpx2.Response, int]:
        """Send with retries; returns the final response (2xx or a non-retryable 4xx) and the attempt index.
        ``extra_s`` (a command's own timeout) extends both deadlines; ``retry_full`` False returns a 429 at once."""
        deadline = None if self.call_timeout_s is None else time.monotonic() + self.call_timeout_s + extra_s
        for attempt in range(self.max_retries + 1):
            attempt_s = self.timeout_s + extra_s
            if deadline is not None:
                attempt_s = min(attempt_s, deadline - time.monotonic())
            try:
                request = self._http.build_request(method, path, json=json, params=params,
                                                   timeout=httpx2.Timeout(max(attempt_s, 1e-3)))
            except UnicodeEncodeError as exc:  # a lone surrogate: no server could store it as UTF-8
                raise SandboxRequestError(f"{method} {path}: text is not valid Unicode ({exc.reason} at "
                                          f"position {exc.start})", code="invalid_encoding") from None
            last = attempt == self.max_retries
            try:
                response = await self._http.send(request)
            except httpx2.TransportError as exc:  # connect/read errors, resets, timeouts
                if last or _expired(deadline):
                    within = "" if deadline is None else f" within call_timeout_s={self.call_timeout_s + extra_s:g} s"
                    raise SandboxUnreachable(
                        f"{method} {path}: sandbox server unreachable after {attempt + 1} attempts{within}: "
                        f"{type(exc).__name__}: {exc}") from exc
                await _sleep(self._backoff(attempt), deadline)
                continue
            status = response.status_code
            if status == 429 and not retry_full:
                return response, attempt
            if status == 429 or status >= 500:
                if last or _expired(deadline):
                    raise _classify(response, method, path, attempts=attempt + 1)
                await _sleep(_retry_after(response) if status == 429 else self._backoff(attempt), deadline)
                continue
            return response, attempt
        raise AssertionError("unreachable")

    async def _call(self, method: str, path: str, *, ok: int = 200, **kwargs: Any) -> httpx2.Response:
        response, _ = await self._request(method, path, **kwargs)
        if response.status_code != ok:
            raise _classify(response, method, path)
        return response

    async def _answer(self, method: str, path: str, *keys: str, ok: int = 200, **kwargs: Any) -> dict:
        """The JSON object of a successful call, holding ``keys``; a body that is not one is the
        service's fault (:class:`SandboxInfraError`), never the agent's and never a raw decode error."""
        response = await self._call(method, path, ok=ok, **kwargs)
        try:
            data = response.json()
        except ValueError:  # JSONDecodeError, UnicodeDecodeError
            data = None
        if not isinstance(data, dict) or any(key not in data for key in keys):
            raise SandboxInfraError(f"{method} {path} -> {response.status_code}: an answer that is not the "
                                    f"protocol's (a JSON object with {', '.join(keys) or 'fields'}): "
                                    f"{response.text[:200]!r}")
        return data

    # ---- protocol ---------------------------------------------------------------------------------
    async def health(self) -> dict:
        return await self._answer("GET", "/v1/health")

    async def create(self, files: dict[str, str | bytes], *, ttl_s: float | None = None,
                     network: bool = False, wait_if_full: bool = True, idempotency_key: str | None = None) -> str:
        """A new sandbox holding ``files``; its id. ``wait_if_full`` False: a full server's 429 is a
        :class:`SandboxCapacityError` at once (a fleet then asks another server) instead of a retry.
        ``idempotency_key`` (default: a new one): the same call with the same key later answers the
        sandbox the first one made, e.g. to find and delete one whose answer was lost."""
        text: dict[str, str] = {}
        binary: dict[str, str] = {}
        for path, content in files.items():
            if isinstance(content, bytes):
                binary[path] = base64.b64encode(content).decode()
            elif isinstance(content, str):
                text[path] = content
            else:
                raise TypeError(f"files[{path!r}] must be str or bytes, got {type(content).__name__}")
        body = {"files": text, "binary_files": binary, "ttl_s": ttl_s, "network": network,
                "idempotency_key": idempotency_key or uuid.uuid4().hex}
        return (await self._answer("POST", "/v1/sandboxes", "id", ok=201, json=body, retry_full=wait_if_full))["id"]

    async def exec(self, sandbox_id: str, command: str | list[str], *, stdin: str | None = None,
                   timeout_s: float = 30.0, env: dict | None = None,
                   peer_command: list[str] | None = None, lazy_peer: bool = False,
                   gateway_url: str | None = None) -> ExecResult:
        """Run a command. Returns the result whatever the exit code; raises CommandTimeout past ``timeout_s``.
        ``peer_command``: a second process as the sandbox's uid, piped to ``command`` (see docs/sandbox.md);
        ``lazy_peer``: started only at the command's first write to it; ``gateway_url``
        (``http://HOST:PORT/PATH``): the one endpoint the command reaches, at ``http://127.0.0.1:PORT/PATH``."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        body = {"command": command, "stdin": stdin, "env": env or {}, "timeout_s": timeout_s,
                "idempotency_key": uuid.uuid4().hex}
        if peer_command is not None:
            body["peer_command"] = peer_command
        if lazy_peer:
            body["lazy_peer"] = True
        if gateway_url is not None:
            body["gateway_url"] = gateway_url
        # Both deadlines cover the command's own timeout plus the usual request budget.
        data = await self._answer("POST", f"/v1/sandboxes/{sandbox_id}/exec", json=body, extra_s=timeout_s)
        try:
            result = ExecResult.from_json(data)
        except (KeyError, TypeError, ValueError) as err:
            raise SandboxInfraError(f"POST /v1/sandboxes/{sandbox_id}/exec: an answer that is not an exec result "
                                    f"({type(err).__name__}: {err})") from None
        if result.timed_out:
            raise CommandTimeout(f"command timed out after {timeout_s} s and was killed", result)
        return result

    async def read_bytes(self, sandbox_id: str, path: str) -> bytes:
        data = await self._answer("GET", f"/v1/sandboxes/{sandbox_id}/file", "encoding", "content", params={"path": path})
        if data["encoding"] == "base64":
            return base64.b64decode(data["content"])
        return data["content"].encode()

    async def read_file(self, sandbox_id: str, path: str) -> str:
        data = await self._answer("GET", f"/v1/sandboxes/{sandbox_id}/file", "encoding", "content", params={"path": path})
        if data["encoding"] != "utf-8":
            raise SandboxRequestError(f"{path!r} is not UTF-8 text (use read_bytes)", code="not_text")
        return data["content"]

    async def write_file(self, sandbox_id: str, path: str, content: str | bytes) -> None:
        if isinstance(content, bytes):
            body = {"path": path, "content": base64.b64encode(content).decode(), "encoding": "base64"}
        else:
            body = {"path": path, "content": content, "encoding": "utf-8"}
        await self._call("PUT", f"/v1/sandboxes/{sandbox_id}/file", ok=204, json=body)

    async def list_files(self, sandbox_id: str) -> list[str]:
        return (await self._answer("GET", f"/v1/sandboxes/{sandbox_id}/files", "files"))["files"]

    async def fork(self, sandbox_id: str) -> str:
        """A copy of the sandbox. The server is told how long this client waits for one attempt (less a
        margin for the answer's way back): a copy not done by then is discarded and refused with 422
        ``snapshot_too_slow`` (:class:`SandboxRequestError`: the agent's workspace is too slow to copy),
        never left behind for the TTL."""
        body = {"idempotency_key": uuid.uuid4().hex, "timeout_s": max(self.timeout_s - _FORK_MARGIN_S, self.timeout_s / 2)}
        return (await self._answer("POST", f"/v1/sandboxes/{sandbox_id}/fork", "id", ok=201, json=body))["id"]

    async def delete(self, sandbox_id: str) -> None:
        response, attempt = await self._request("DELETE", f"/v1/sandboxes/{sandbox_id}")
        if response.status_code == 404 and attempt > 0:
            return  # an earlier attempt deleted it before its answer was lost
        if response.status_code != 204:
            raise _classify(response, "DELETE", f"/v1/sandboxes/{sandbox_id}")


def _expired(deadline: float | None, margin_s: float = 0.01) -> bool:
    return deadline is not None and deadline - time.monotonic() < margin_s


async def _sleep(seconds: float, deadline: float | None) -> None:
    """Back off, but never past the call's deadline (the last attempt gets what is left)."""
    if deadline is not None:
        seconds = min(seconds, max(0.0, deadline - time.monotonic() - 0.05))
    await asyncio.sleep(seconds)


def _retry_after(response: httpx2.Response) -> float:
    try:
        return min(_MAX_RETRY_AFTER_S, max(0.0, float(response.headers.get("retry-after", "1"))))
    except ValueError:
        return 1.0


def _classify(response: httpx2.Response, method: str, path: str, attempts: int = 1) -> SandboxError:
    status = response.status_code
    try:
        error = response.json().get("error", {})
        code, message = error.get("code"), error.get("message", "")
    except (ValueError, AttributeError):
        code, message = None, response.text[:500]
    text = f"{method} {path} -> {status}{f' {code}' if code else ''}: {message}"
    if attempts > 1:
        text += f" (after {attempts} attempts)"
    error = error_for(status, code, text)
    if isinstance(error, SandboxCapacityError):
        error.retry_after_s = _retry_after(response)
    return error
