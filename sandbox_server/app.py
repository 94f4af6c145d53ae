"""The FastAPI application of protocol v1: a :class:`SandboxManager` (the live sandboxes and every
operation on them: create, fork, exec, files, delete, reaping, capacity, idempotent retries, metrics)
behind thin routes, with bearer auth and the request-size cap in an ASGI guard before any parsing.

Error bodies are always ``{"error": {"code": str, "message": str}}`` so any client (or fleet
implementation) can classify them without parsing prose; the codes are listed in docs/sandbox.md.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import functools
import hashlib
import hmac
import json
import logging
import math
import os
import re
import tempfile
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandbox_client.models import ExecResult
from sandbox_server import PROTOCOL_VERSION
from sandbox_server.gateway_proxy import (
    SOCKET_DIR,
    GatewayProxy,
    GatewayUrlError,
    forward_argv,
    parse_gateway_url,
)
from sandbox_server.isolation import Isolation, pair_spec_arg, refused_env_name
from sandbox_server.limits import (
    Cgroups,
    claim_root,
    claim_uids,
    default_root,
    mount_tmpfs,
    total_processes,
    unmount,
)
from sandbox_server.options import ServerOptions
from sandbox_server.workspace import (
    ChargedWriter,
    WorkspaceError,
    check_relative,
    chown_tree,
    copy_tree,
    copy_tree_charged,
    list_files,
    read_bytes,
    remove_tree,
    write_bytes,
)

log = logging.getLogger("sandbox_server")
# Copies and ownership walks of whole workspaces (create, fork): apart from the default executor that
# serves single-file calls, so a slow snapshot never stalls other sandboxes' reads and writes.
_TREE_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="sandbox-tree")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ID = re.compile(r"^[0-9a-f]{32}$")


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers or {}


def _error(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": {"code": code, "message": message[:2000]}}, status_code=status, headers=headers)


# ---- request / response models ----------------------------------------------------------------
class StrictRequest(BaseModel):
    """Requests take JSON types as they are: ``timeout_s: true`` or ``"30"`` is a 422 naming the field,
    not a 1 s or 30 s timeout (pydantic's lax mode would coerce them). An integer is still a number."""

    model_config = ConfigDict(strict=True, extra="forbid")  # a typo ("ttl") is a 422, not a silent default


class CreateRequest(StrictRequest):
    files: dict[str, str] = Field(default_factory=dict, description="path -> UTF-8 text")
    binary_files: dict[str, str] = Field(default_factory=dict, description="path -> base64 bytes")
    ttl_s: float | None = Field(default=None, description="idle time before the sandbox is reaped")
    network: bool = Field(default=False, description="share the host network (off by default)")
    idempotency_key: str | None = Field(default=None, max_length=200)


class ForkRequest(StrictRequest):
    ttl_s: float | None = None
    timeout_s: float | None = Field(
        default=None, description="how long the client waits: a copy not done by then is discarded and answered "
        "503 service_busy; a copy that runs past the server's fork_timeout_s from its own start, 422 snapshot_too_slow")
    idempotency_key: str | None = Field(default=None, max_length=200)


class SandboxInfo(BaseModel):
    id: str
    network: bool
    ttl_s: float
    expires_in_s: float


class ExecRequest(StrictRequest):
    command: str | list[str] = Field(description="shell string (run by /bin/sh -c) or argv list")
    stdin: str | None = None
    env: dict[str, str] = Field(default_factory=dict)
    peer_command: list[str] | None = Field(
        default=None, description="argv of a second process run as the sandbox's uid, while `command` runs as the "
        "sandbox's judge uid; the command's fds 3, 4 and 5 are pipes to the peer's stdin, from its stdout and "
        "from its stderr (scoring: docs/sandbox.md)")
    lazy_peer: bool = Field(
        default=False, description="start the peer only when the command first writes to its fd 3, so a command "
        "that never asks costs no second process; a command that reads fd 4 or 5 before writing fd 3 then waits "
        "until its timeout")
    timeout_s: float = 30.0
    gateway_url: str | None = Field(
        default=None, description="http://HOST:PORT/PATH: the one endpoint the command may reach, at "
        "http://127.0.0.1:PORT/PATH inside its sandbox (only paths under PATH; bwrap isolation only; "
        "docs/sandbox.md)")
    idempotency_key: str | None = Field(default=None, max_length=200)


class FileBody(StrictRequest):
    path: str
    content: str
    encoding: str = Field(default="utf-8", pattern="^(utf-8|base64)$")


class FileList(BaseModel):
    files: list[str]


# ---- state --------------------------------------------------------------------------------------
@dataclass
class Sandbox:
    id: str
    root: Path
    network: bool
    ttl_s: float
    slot: int = 0  # index among live sandboxes: picks its uid (sandbox_uid + slot)
    last_used: float = field(default_factory=time.monotonic)
    tasks: set[asyncio.Task] = field(default_factory=set)

    @property
    def workspace(self) -> Path:
        return self.root / "workspace"

    @property
    def home(self) -> Path:
        return self.root / "home"

    def touch(self) -> None:
        self.last_used = time.monotonic()

    def expires_in(self) -> float:
        return self.last_used + self.ttl_s - time.monotonic()


_SMALL_ANSWER_BYTES = 512  # what a create or fork answer (a SandboxInfo) is counted as


@dataclass
class _Kept:
    """One keyed request: its fingerprint and, until its answer is dropped, the shared future."""

    deadline: float
    fingerprint: str
    scope: str  # the sandbox whose budget holds the answer ("" for create)
    future: asyncio.Future | None  # None: the answer was dropped (budget); a retry gets 410
    num_bytes: int = 0


class IdempotencyCache:
    """Results of keyed requests, so a retried exec/create/fork returns the first result instead of
    running again. An in-flight request is shared: the retry awaits the same task. A key comes with
    the fingerprint of its request: the same key on a different request is refused (422
    ``idempotency_key_reused``), never answered with the first request's result.

    Answers are bounded in bytes: per sandbox (``max_bytes_per_scope``, the oldest of that sandbox
    go first) and in total (``max_bytes``, taken from the sandbox holding the most). A dropped
    answer leaves its key and fingerprint: a retry of it is answered 410 ``answer_dropped`` and never
    runs again. A sandbox's entries go with it (:meth:`drop_scope`)."""

    def __init__(self, ttl_s: float, max_bytes_per_scope: int, max_bytes: int, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_bytes_per_scope = max_bytes_per_scope
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.num_bytes = 0
        self._entries: dict[str, _Kept] = {}  # insertion order = age
        self._scopes: dict[str, dict[str, None]] = {}  # scope -> its keys holding an answer, oldest first
        self._scope_bytes: Counter[str] = Counter()

    async def run(self, key: str | None, scope: str, request: BaseModel, factory) -> Any:
        if key is None:
            return await factory()
        fingerprint = _fingerprint(request)
        now = time.monotonic()
        self._expire(now)
        entry = self._entries.get(key)
        if entry is None:
            future = asyncio.ensure_future(factory())
            self._entries[key] = _Kept(now + self.ttl_s, fingerprint, scope, future)
            future.add_done_callback(lambda f: self._settle(key, f))
        elif entry.fingerprint != fingerprint:
            operation, _, user_key = key.split(":", 2)
            raise ApiError(422, "idempotency_key_reused", f"idempotency key {user_key[:200]!r} was already used "
                           f"for a different {operation} request; use a new key for a new request")
        elif entry.future is None:
            operation, _, user_key = key.split(":", 2)
            raise ApiError(410, "answer_dropped", f"the {operation} request with idempotency key {user_key[:200]!r} "
                           "ran, but its answer was not kept (the server's answer budget, idempotency_max_bytes*, "
                           "was full); it is not run again")
        else:
            future = entry.future
        # shield: a client that disconnects must not cancel the command; its retry will collect it.
        return await asyncio.shield(future)

    def _settle(self, key: str, future: asyncio.Future) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.future is not future:
            return  # dropped with its sandbox meanwhile
        if future.cancelled() or future.exception() is not None:
            del self._entries[key]
            return
        result = future.result()
        entry.num_bytes = len(result) if isinstance(result, bytes) else _SMALL_ANSWER_BYTES
        self._scopes.setdefault(entry.scope, {})[key] = None
        self._scope_bytes[entry.scope] += entry.num_bytes
        self.num_bytes += entry.num_bytes
        while self._scope_bytes[entry.scope] > self.max_bytes_per_scope:
            self._drop_oldest(entry.scope)
        while self.num_bytes > self.max_bytes:
            self._drop_oldest(max(self._scope_bytes, key=self._scope_bytes.__getitem__))

    def _drop_oldest(self, scope: str) -> None:
        """Forget the answer of the scope's oldest kept request; its key stays, answered 410."""
        keys = self._scopes[scope]
        key = next(iter(keys))
        del keys[key]
        self._release(self._entries[key])

    def drop_scope(self, scope: str) -> None:
        """Forget every request of a deleted sandbox (its retries then meet 404 ``sandbox_not_found``)."""
        for key in [k for k, entry in self._entries.items() if entry.scope == scope]:
            self._forget(key)
        self._scopes.pop(scope, None)

    def _forget(self, key: str) -> None:
        entry = self._entries.pop(key)
        if key in self._scopes.get(entry.scope, {}):
            del self._scopes[entry.scope][key]
            self._release(entry)

    def _release(self, entry: _Kept) -> None:
        self._scope_bytes[entry.scope] -= entry.num_bytes
        self.num_bytes -= entry.num_bytes
        if self._scope_bytes[entry.scope] <= 0:
            del self._scope_bytes[entry.scope]
        entry.future, entry.num_bytes = None, 0

    def _expire(self, now: float) -> None:
        stale = []
        for key, entry in self._entries.items():  # oldest first: stop at the first one still fresh
            if entry.deadline >= now:
                break
            if entry.future is None or entry.future.done():
                stale.append(key)
        for key in stale:
            self._forget(key)
        while len(self._entries) > self.max_entries:
            self._forget(next(iter(self._entries)))


class Metrics:
    def __init__(self) -> None:
        self.counters: Counter[tuple[str, tuple[tuple[str, str], ...]]] = Counter()

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        self.counters[(name, tuple(sorted(labels.items())))] += value

    def render(self, gauges: dict[str, float]) -> str:
        lines: list[str] = []
        seen: set[str] = set()
        for (name, labels), value in sorted(self.counters.items()):
            if name not in seen:
                lines.append(f"# TYPE sandbox_{name} counter")
                seen.add(name)
            label_text = ",".join(f'{k}="{v}"' for k, v in labels)
            lines.append(f"sandbox_{name}{{{label_text}}} {value}" if label_text else f"sandbox_{name} {value}")
        for name, value in gauges.items():
            lines.append(f"# TYPE sandbox_{name} gauge")
            lines.append(f"sandbox_{name} {value}")
        return "\n".join(lines) + "\n"


# ---- ASGI middleware: auth and body size, before any parsing ----------------------------------
class GuardMiddleware:
    """Bearer auth on every path (hmac.compare_digest) and a hard cap on request bodies (413)."""

    def __init__(self, app, token: str, max_body: int, body_timeout_s: float = 60.0) -> None:
        self.app = app
        self._expected = f"Bearer {token}".encode()
        self.max_body = max_body
        self.body_timeout_s = body_timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if not hmac.compare_digest(headers.get(b"authorization", b""), self._expected):
            response = _error(401, "unauthorized", "missing or wrong bearer token",
                              {"WWW-Authenticate": "Bearer"})
            return await response(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            response = _error(413, "payload_too_large",
                              f"request body of {int(declared)} bytes exceeds the limit {self.max_body}")
            return await response(scope, receive, send)
        # Read the whole body here (FastAPI buffers it anyway) so an oversized one, chunked or not,
        # is a 413 before any parsing; the app then gets it back in one message.
        chunks: list[bytes] = []
        received = 0
        deadline = asyncio.get_running_loop().time() + self.body_timeout_s
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                response = _error(408, "request_timeout", f"the request body did not arrive within "
                                  f"{self.body_timeout_s:g} s", {"Connection": "close"})
                return await response(scope, receive, send)
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            received += len(chunk)
            if received > self.max_body:
                response = _error(413, "payload_too_large", f"request body exceeds the limit {self.max_body}",
                                  {"Connection": "close"})
                return await response(scope, receive, send)
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        delivered = False

        async def replay():
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)


# ---- the service: state and operations, apart from HTTP ----------------------------------------
class SandboxManager:
    """Every live sandbox and what can be done to it: create, fork, exec, files, delete, reaping.

    The routes below are thin: they parse the request and hand it here. Capacity is a pool of slots
    (slot i runs as uid ``sandbox_uid + i``); keyed requests go through the idempotency cache; every
    outcome is counted in ``metrics``. One manager per server; :meth:`close` removes every sandbox."""

    def __init__(self, options: ServerOptions) -> None:
        self.options = options
        self.root, self._locks, self.isolation, self.cgroups, self.disk_quota = _prepare_host(options)
        self.sandboxes: dict[str, Sandbox] = {}
        self._free_slots = list(range(options.max_sandboxes - 1, -1, -1))  # pop() hands out slot 0 first
        self.idempotency = IdempotencyCache(options.idempotency_ttl_s, options.idempotency_max_bytes_per_sandbox,
                                            options.idempotency_max_bytes)
        self.metrics = Metrics()
        self._writer = ChargedWriter()

    # ---- lifecycle
    def get(self, sandbox_id: str) -> Sandbox:
        box = self.sandboxes.get(sandbox_id) if _ID.match(sandbox_id) else None
        if box is None:
            raise ApiError(404, "sandbox_not_found", f"no sandbox {sandbox_id[:80]!r} (deleted, reaped or never created)")
        box.touch()
        return box

    def ttl(self, requested: float | None) -> float:
        if requested is None:
            return self.options.default_ttl_s
        if not 0 < requested <= self.options.max_ttl_s:
            raise ApiError(400, "invalid_request", f"ttl_s must be in (0, {self.options.max_ttl_s}], got {requested}")
        return requested

    async def _open_box(self, network: bool, ttl_s: float) -> Sandbox:
        """Take a slot (429 when none is left), then the sandbox's folder, disk quota and cgroup."""
        if not self._free_slots:
            self.metrics.inc("create_rejected_total")
            raise ApiError(429, "capacity", f"server is full ({self.options.max_sandboxes} sandboxes)",
                           {"Retry-After": str(self.options.capacity_retry_after_s)})
        sandbox_id = uuid.uuid4().hex
        box = Sandbox(sandbox_id, self.root / sandbox_id, network, ttl_s, slot=self._free_slots.pop())
        try:
            await asyncio.to_thread(_make_box_dirs, box, self.options, self.disk_quota, self.cgroups)
        except BaseException:
            await self._discard(box)
            raise
        return box

    async def _discard(self, box: Sandbox) -> None:
        """Undo _open_box: processes, cgroup, mount, folder, slot."""
        try:
            await asyncio.get_running_loop().run_in_executor(
                _TREE_POOL, _remove_box_dirs, box, self.disk_quota, self.cgroups)
        finally:
            self._free_slots.append(box.slot)

    async def _fill_and_register(self, box: Sandbox, fill, *, owned: bool = False) -> None:
        """Run ``fill`` (a blocking function writing the workspace), hand the tree to the sandbox's uid
        (unless ``fill`` did, ``owned``) and make it live; on any failure the box is discarded. Whole-tree work
        runs on a pool of its own: a slow copy never delays another sandbox's file calls."""
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(_TREE_POOL, fill)
            owner = self.isolation.owner(box.slot)
            if owner is not None and not owned:
                await loop.run_in_executor(_TREE_POOL, functools.partial(chown_tree, box.root, owner))
            self.sandboxes[box.id] = box
            self.metrics.inc("created_total")
        except BaseException:
            await self._discard(box)
            raise

    async def _destroy(self, box: Sandbox, reason: str) -> None:
        if self.sandboxes.pop(box.id, None) is None:
            return  # a concurrent delete got there first
        for task in list(box.tasks):
            task.cancel()
        if box.tasks:
            await asyncio.wait(box.tasks, timeout=10)
        self.idempotency.drop_scope(box.id)
        await self._discard(box)
        self.metrics.inc("deleted_total", reason=reason)

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.options.reap_interval_s)
            for box in list(self.sandboxes.values()):
                if not box.tasks and box.expires_in() < 0:
                    log.info("reaping idle sandbox %s", box.id)
                    await self._destroy(box, "reaped")

    async def close(self) -> None:
        """Remove every sandbox, then release the root and the uids for the next server."""
        try:
            for box in list(self.sandboxes.values()):
                await self._destroy(box, "shutdown")
        finally:
            self._writer.close()
            for lock in self._locks:
                os.close(lock)

    # ---- operations
    async def create(self, body: CreateRequest, header_key: str | None) -> SandboxInfo:
        key = _scoped("create", "", body.idempotency_key or header_key)
        return await self.idempotency.run(key, "", body, functools.partial(self._create, body))

    async def _create(self, body: CreateRequest) -> SandboxInfo:
        ttl_s = self.ttl(body.ttl_s)
        blobs = _snapshot(body)
        if len(blobs) > self.options.max_files:
            raise ApiError(413, "payload_too_large", f"snapshot has more than {self.options.max_files} files")
        box = await self._open_box(body.network, ttl_s)
        await self._fill_and_register(box, functools.partial(_write_all, box.workspace, blobs,
                                                             self.options.max_file_bytes))
        return _info(box, box.ttl_s)

    async def fork(self, sandbox_id: str, body: ForkRequest, header_key: str | None) -> SandboxInfo:
        source = self.get(sandbox_id)
        key = _scoped("fork", sandbox_id, body.idempotency_key or header_key)
        return await self.idempotency.run(key, sandbox_id, body, functools.partial(self._fork, source, body))

    async def _fork(self, source: Sandbox, body: ForkRequest) -> SandboxInfo:
        ttl_s = self.ttl(body.ttl_s) if body.ttl_s is not None else source.ttl_s
        client_deadline = math.inf  # past it the client has gone: never register a fork then
        if body.timeout_s is not None:
            if body.timeout_s <= 0:
                raise ApiError(400, "invalid_request", f"timeout_s must be positive, got {body.timeout_s}")
            client_deadline = time.monotonic() + body.timeout_s
        box = await self._open_box(source.network, ttl_s)
        owner = self.isolation.owner(box.slot)
        procs = self.cgroups.procs_files(box.id) if self.cgroups is not None else None

        def fill() -> None:
            # The agent is charged with fork_timeout_s of copying from when its copy starts, not with time spent
            # queued behind other sandboxes' copies: a copy cut by the client's wait, or never started within it,
            # is the service being busy (503, retried; never 422, which scores the submission 0).
            started = time.monotonic()
            deadline = min(started + self.options.fork_timeout_s, client_deadline)
            if started >= client_deadline:
                raise WorkspaceError("service_busy", 503, "the server was too busy to start the copy in time")
            try:
                if procs is not None:  # the copy's pages count against the new sandbox's memory limit
                    copy_tree_charged(source.workspace, box.workspace, procs, owner=None,
                                      max_files=self.options.max_files, deadline=deadline)
                else:
                    copy_tree(source.workspace, box.workspace, owner=None, max_files=self.options.max_files,
                              deadline=deadline)
                if owner is not None:
                    chown_tree(box.root, owner, deadline=deadline)
            except WorkspaceError as exc:
                if exc.code == "snapshot_too_slow" and deadline == client_deadline:
                    raise WorkspaceError("service_busy", 503, "the server was too busy to finish the copy before "
                                         "the client's wait ran out") from exc
                raise

        await self._fill_and_register(box, fill, owned=True)
        self.metrics.inc("forked_total")
        return _info(box, box.ttl_s)

    def info(self, sandbox_id: str) -> SandboxInfo:
        box = self.get(sandbox_id)
        return _info(box, box.expires_in())

    async def delete(self, sandbox_id: str) -> None:
        await self._destroy(self.get(sandbox_id), "deleted")

    async def exec(self, sandbox_id: str, body: ExecRequest, header_key: str | None) -> bytes:
        """Run a command; the answer is ExecResult's JSON, encoded here (FastAPI's validate-then-encode
        of the answer costs more than the rest of the route on ``echo hi``)."""
        box = self.get(sandbox_id)
        command = _prepare_exec(body, self.options.max_timeout_s)
        if command.gateway_url is not None and (self.isolation.backend != "bwrap" or box.network):
            raise ApiError(400, "invalid_request", "gateway_url needs bwrap isolation and a sandbox created without "
                           "network: without a network namespace of its own the command reaches every address the "
                           "host reaches")
        key = _scoped("exec", sandbox_id, body.idempotency_key or header_key)
        try:
            return await self.idempotency.run(key, sandbox_id, body, functools.partial(self._exec, box, command))
        except asyncio.CancelledError:
            if sandbox_id not in self.sandboxes:
                raise ApiError(404, "sandbox_not_found", f"sandbox {sandbox_id} was deleted during exec") from None
            raise

    async def _exec(self, box: Sandbox, command: _Command) -> bytes:
        task = asyncio.current_task()
        assert task is not None
        box.tasks.add(task)
        try:
            async with _gateway(command) as (argv, binds):
                result = await self.isolation.run(box.workspace, box.home, argv, stdin=command.stdin,
                                                  env=command.env, slot=box.slot, cgroup=box.id, peer=command.peer,
                                                  lazy_peer=command.lazy_peer, binds=binds,
                                                  timeout_s=command.timeout_s, network=box.network)
        finally:
            box.tasks.discard(task)
            box.touch()
        outcome = "timeout" if result.timed_out else ("ok" if result.exit_code == 0 else "nonzero")
        self.metrics.inc("exec_total", outcome=outcome)
        self.metrics.inc("exec_seconds_total", result.duration_s)
        if result.truncated:
            self.metrics.inc("exec_truncated_total")
        answer = {"exit_code": result.exit_code, "stdout": result.stdout.decode("utf-8", errors="replace"),
                  "stderr": result.stderr.decode("utf-8", errors="replace"), "timed_out": result.timed_out,
                  "truncated": result.truncated, "duration_s": round(result.duration_s, 6)}
        return json.dumps(answer, ensure_ascii=False).encode()

    async def list_files(self, sandbox_id: str) -> FileList:
        box = self.get(sandbox_id)
        return FileList(files=await asyncio.to_thread(list_files, box.workspace, self.options.max_files))

    async def read_file(self, sandbox_id: str, path: str) -> FileBody:
        box = self.get(sandbox_id)
        data = await asyncio.to_thread(read_bytes, box.workspace, path, self.options.max_file_bytes)
        try:
            return FileBody(path=path, content=data.decode("utf-8"), encoding="utf-8")
        except UnicodeDecodeError:
            return FileBody(path=path, content=base64.b64encode(data).decode(), encoding="base64")

    async def write_file(self, sandbox_id: str, body: FileBody) -> None:
        box = self.get(sandbox_id)
        if body.encoding == "base64":
            data = _base64(body.content, "content")
        else:
            data = _text(body.content, "content").encode()
        owner, max_bytes = self.isolation.owner(box.slot), self.options.max_file_bytes
        if self.cgroups is None:
            await asyncio.to_thread(write_bytes, box.workspace, body.path, data, owner=owner, max_bytes=max_bytes)
            return
        # written from inside the sandbox's memory group: the pages count against its limit, not the server's
        await asyncio.to_thread(self._writer.write, self.cgroups.memory_procs_file(box.id), box.workspace, body.path,
                                data, owner=owner, max_bytes=max_bytes)

    # ---- reports
    def health(self) -> dict:
        options = self.options
        limits = {name: getattr(options, name) for name in _HEALTH_LIMITS}
        limits["total_memory_bytes"] = self.cgroups.total_memory_bytes if self.cgroups is not None else None
        limits["total_processes"] = self.cgroups.total_pids if self.cgroups is not None else None
        return {"status": "ok", "protocol": PROTOCOL_VERSION, "isolation": dataclasses.asdict(self.isolation.report),
                "sandboxes": {"active": len(self.sandboxes), "max": options.max_sandboxes}, "limits": limits,
                "tools": bool(options.tools_dir) and self.isolation.backend == "bwrap",
                "gateway": self.isolation.backend == "bwrap"}

    def metrics_text(self) -> str:
        return self.metrics.render({"active": len(self.sandboxes), "max": self.options.max_sandboxes,
                                    "running_execs": sum(len(b.tasks) for b in self.sandboxes.values()),
                                    "idempotency_bytes": self.idempotency.num_bytes})


# /v1/health's limits (total_memory_bytes: what the cgroups enforce, the option's 0 resolved)
_HEALTH_LIMITS = ("output_limit_bytes", "max_request_bytes", "max_file_bytes", "max_timeout_s", "default_ttl_s",
                  "cpu_time_s", "address_space_bytes", "max_processes", "file_size_bytes", "open_files",
                  "memory_bytes", "total_memory_bytes", "max_sandboxes", "disk_bytes", "tmp_bytes")


def _prepare_host(options: ServerOptions) -> tuple[Path, list[int], Isolation, Cgroups | None, bool]:
    """Claim the sandboxes' root and uids, and probe what the host allows: cgroups, tmpfs quotas, the
    backend. Returns the locks' fds among the rest (closed when the server stops).

    A stable root, locked while this server lives and emptied at start: a killed server's leftovers
    are removed by the next one instead of piling up. A root server's sandbox and judge uids
    (``2 x max_sandboxes`` from ``sandbox_uid``) are locked too: another server on this host takes
    the next free range instead of sharing them."""
    root, root_lock = claim_root(Path(options.root_dir) if options.root_dir else default_root(),
                                 stable_default=not options.root_dir)
    locks = [root_lock]
    try:
        if os.geteuid() == 0 and options.sandbox_uid >= 0:
            first, uid_lock = claim_uids(options.sandbox_uid, 2 * options.max_sandboxes)
            locks.append(uid_lock)
            if first != options.sandbox_uid:
                log.warning("uids %d.. are held by another sandbox server on this host: using %d..",
                            options.sandbox_uid, first)
                options = options.model_copy(update={"sandbox_uid": first})
        root.chmod(0o711)  # the sandbox uids may traverse, not list
        probe_dir = Path(tempfile.mkdtemp(dir=root, prefix="probe-"))
        probe_dir.chmod(0o755)
        num_processes = total_processes(options.max_sandboxes, options.max_processes, options.total_processes)
        cgroups, cgroup_note = Cgroups.detect(root, options.max_processes, options.memory_bytes,
                                              options.total_memory_bytes, num_processes)
        disk_quota = os.geteuid() == 0 and _can_mount_tmpfs(probe_dir)
        try:
            isolation = Isolation(options, probe_dir, cgroups, cgroup_note, disk_quota)
        finally:
            remove_tree(probe_dir)
    except BaseException:
        for lock in locks:
            os.close(lock)
        raise
    log.info("isolation backend: %s (uid %s)", isolation.backend, isolation.report.uid)
    for note in isolation.report.notes:
        log.warning(note)
    return root, locks, isolation, cgroups, disk_quota


# ---- HTTP: the application, its error handlers and thin routes --------------------------------
def create_app(options: ServerOptions) -> FastAPI:
    if not options.token:
        raise ValueError("a token is required (--token or SANDBOX_SERVER_TOKEN)")
    manager = SandboxManager(options)
    app = FastAPI(title="lightning-agentrl sandbox service", version=PROTOCOL_VERSION, lifespan=_lifespan,
                  openapi_url="/v1/openapi.json", docs_url=None, redoc_url=None)
    app.state.manager = manager
    for error, handler in _ERROR_HANDLERS.items():
        app.add_exception_handler(error, handler)
    app.include_router(router)
    # The guard wraps everything, the OpenAPI schema included.
    app.add_middleware(GuardMiddleware, token=options.token, max_body=options.max_request_bytes,
                       body_timeout_s=options.body_timeout_s)
    return app


@contextlib.asynccontextmanager
async def _lifespan(app: FastAPI):
    manager: SandboxManager = app.state.manager
    task = asyncio.create_task(manager.reap_forever())
    try:
        yield
    finally:
        task.cancel()
        await manager.close()


def _metrics(request: Request) -> Metrics:
    return request.app.state.manager.metrics


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    _metrics(request).inc("errors_total", code=exc.code)
    return _error(exc.status, exc.code, exc.message, exc.headers)


async def _workspace_error(request: Request, exc: WorkspaceError) -> JSONResponse:
    _metrics(request).inc("errors_total", code=exc.code)
    return _error(exc.status, exc.code, exc.message)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    # Still a typed JSON error (the client retries 5xx, then raises SandboxInfraError); logged with its trace.
    log.exception("unexpected error", exc_info=exc)
    _metrics(request).inc("errors_total", code="internal")
    return _error(500, "internal", f"{type(exc).__name__}: {exc}")


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    # The router's own answers (unknown path, wrong method) in the same typed shape as every other error.
    if exc.status_code == 400 and exc.__cause__ is not None:
        # FastAPI's body parser: JSON nested past the decoder's depth (RecursionError) or bytes that
        # are not UTF-8. A malformed body, like any other: the documented 422 invalid_request.
        return await _validation_error(request, RequestValidationError([{
            "loc": ("body",), "msg": f"not valid JSON ({_parse_failure(exc.__cause__)})"}]))
    code = {404: "route_not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
    parts = request.url.path.split("/")
    if exc.status_code == 404 and parts[1:3] == ["v1", "sandboxes"] and len(parts) > 3 and not _ID.match(parts[3]):
        code = "sandbox_not_found"  # no sandbox has that id (it does not even route)
    _metrics(request).inc("errors_total", code=code)
    return _error(exc.status_code, code, str(exc.detail), dict(exc.headers or {}))


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    _metrics(request).inc("errors_total", code="invalid_request")
    details = "; ".join(f"{'.'.join(map(str, e.get('loc', ())))}: {e.get('msg')}" for e in exc.errors())
    return _error(422, "invalid_request", details)


_ERROR_HANDLERS = {ApiError: _api_error, WorkspaceError: _workspace_error, Exception: _unexpected,
                   StarletteHTTPException: _http_error, RequestValidationError: _validation_error}


async def _manager(request: Request) -> SandboxManager:  # async: no thread-pool hop per request
    return request.app.state.manager


Manager = Annotated[SandboxManager, Depends(_manager)]
IdempotencyHeader = Annotated[str | None, Header()]
router = APIRouter(prefix="/v1")


@router.get("/health")
async def health(manager: Manager) -> dict:
    return manager.health()


@router.get("/metrics", response_class=PlainTextResponse)
async def prometheus(manager: Manager) -> str:
    return manager.metrics_text()


@router.get("/sandboxes")
async def list_sandboxes(manager: Manager) -> dict:
    return {"sandboxes": sorted(manager.sandboxes)}


@router.post("/sandboxes", status_code=201)
async def create(body: CreateRequest, manager: Manager, idempotency_key: IdempotencyHeader = None) -> SandboxInfo:
    return await manager.create(body, idempotency_key)


@router.get("/sandboxes/{sandbox_id}")
async def info(sandbox_id: str, manager: Manager) -> SandboxInfo:
    return manager.info(sandbox_id)


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def delete(sandbox_id: str, manager: Manager) -> Response:
    await manager.delete(sandbox_id)
    return Response(status_code=204)


@router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
async def fork(sandbox_id: str, manager: Manager, body: ForkRequest | None = None,
               idempotency_key: IdempotencyHeader = None) -> SandboxInfo:
    return await manager.fork(sandbox_id, body or ForkRequest(), idempotency_key)


@router.post("/sandboxes/{sandbox_id}/exec", response_model=ExecResult)
async def exec_command(sandbox_id: str, body: ExecRequest, manager: Manager,
                       idempotency_key: IdempotencyHeader = None) -> Response:
    answer = await manager.exec(sandbox_id, body, idempotency_key)
    return Response(answer, media_type="application/json")


@router.get("/sandboxes/{sandbox_id}/files")
async def files(sandbox_id: str, manager: Manager) -> FileList:
    return await manager.list_files(sandbox_id)


@router.get("/sandboxes/{sandbox_id}/file")
async def read_file(sandbox_id: str, manager: Manager, path: str = Query(...)) -> FileBody:
    return await manager.read_file(sandbox_id, path)


@router.put("/sandboxes/{sandbox_id}/file", status_code=204)
async def write_file(sandbox_id: str, body: FileBody, manager: Manager) -> Response:
    await manager.write_file(sandbox_id, body)
    return Response(status_code=204)


def _can_mount_tmpfs(probe_dir: Path) -> bool:
    target = probe_dir / "quota"
    target.mkdir()
    try:
        mount_tmpfs(target, 1 << 20, 64)
    except OSError as exc:
        log.warning("no per-sandbox disk quota: cannot mount a tmpfs (%s)", exc.strerror or exc)
        return False
    unmount(target)
    return True


def _make_box_dirs(box: Sandbox, options: ServerOptions, disk_quota: bool, cgroups: Cgroups | None) -> None:
    box.root.mkdir(mode=0o700)
    if disk_quota:
        mount_tmpfs(box.root, options.disk_bytes, max(10_000, 5 * options.max_files))
    box.root.chmod(0o700)  # only its own uid (chowned in register) enters: not another sandbox's
    box.workspace.mkdir()
    box.home.mkdir()
    if cgroups is not None:
        cgroups.create(box.id)


def _remove_box_dirs(box: Sandbox, disk_quota: bool, cgroups: Cgroups | None) -> None:
    if cgroups is not None:
        cgroups.remove(box.id)
    if disk_quota:
        unmount(box.root)
    remove_tree(box.root)


def _info(box: Sandbox, expires_in_s: float) -> SandboxInfo:
    return SandboxInfo(id=box.id, network=box.network, ttl_s=box.ttl_s, expires_in_s=expires_in_s)


@dataclass(frozen=True)
class _Command:
    """An exec request, checked and ready to run."""

    argv: list[str]
    env: dict[str, str]
    peer: list[str] | None
    stdin: bytes | None
    timeout_s: float
    lazy_peer: bool = False
    gateway_url: str | None = None


@contextlib.asynccontextmanager
async def _gateway(command: _Command):
    """The argv to run and the extra binds: with a ``gateway_url``, the command under the in-sandbox forwarder
    and the proxy's socket folder bound at ``SOCKET_DIR`` while it runs (gateway_proxy). The folder is a short
    one under /tmp: a Unix socket's path is limited to 107 bytes."""
    if command.gateway_url is None:
        yield command.argv, ()
        return
    folder = Path(tempfile.mkdtemp(prefix="sbgw-", dir="/tmp" if os.path.isdir("/tmp") else None))
    proxy = GatewayProxy(command.gateway_url, folder)
    try:
        async with proxy:
            yield forward_argv(command.argv, proxy.port), ((str(folder), SOCKET_DIR),)
    finally:
        await asyncio.to_thread(remove_tree, folder)


def _prepare_exec(body: ExecRequest, max_timeout_s: float) -> _Command:
    argv = _argv(body.command)
    env = _env(body.env)
    _check_exec_size(argv, env)
    peer = _argv(body.peer_command) if body.peer_command is not None else None
    if peer is not None:
        _check_exec_size(peer, {})
        _check_pair_spec_size(argv, peer, env)
    elif body.lazy_peer:
        raise ApiError(400, "invalid_request", "lazy_peer needs a peer_command")
    if not 0 < body.timeout_s <= max_timeout_s:
        raise ApiError(400, "invalid_request", f"timeout_s must be in (0, {max_timeout_s}], got {body.timeout_s}")
    stdin = _text(body.stdin, "stdin").encode() if body.stdin is not None else None
    if body.gateway_url is not None:
        if peer is not None:
            raise ApiError(400, "invalid_request", "gateway_url and peer_command do not go together")
        try:
            parse_gateway_url(body.gateway_url)
        except GatewayUrlError as err:
            raise ApiError(400, "invalid_request", str(err)) from None
    return _Command(argv, env, peer, stdin, body.timeout_s, body.lazy_peer, body.gateway_url)


def _snapshot(body: CreateRequest) -> dict[str, bytes]:
    """The create request's files by normalized path. A path given twice (in ``files`` and
    ``binary_files``, or spelled twice as ``a/b`` and ``./a//b``) is a 422 naming it: which copy
    would win is not the client's to guess."""
    named = [(path, _text(text, f"files[{path!r}]").encode()) for path, text in body.files.items()]
    named += [(path, _base64(b64, f"binary_files[{path!r}]")) for path, b64 in body.binary_files.items()]
    blobs: dict[str, bytes] = {}
    for path, data in named:
        normalized = str(check_relative(_text(path, "a path")))
        if normalized in blobs:
            raise ApiError(422, "duplicate_path", f"path {normalized!r} is given twice in one request "
                           "(in files and binary_files, or as two spellings of one path)")
        blobs[normalized] = data
    return blobs


def _base64(text: str, what: str) -> bytes:
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ApiError(400, "invalid_request", f"{what} is not base64") from exc


def _write_all(workspace: Path, blobs: dict[str, bytes], max_bytes: int) -> None:
    for path, data in blobs.items():
        write_bytes(workspace, path, data, owner=None, max_bytes=max_bytes)


def _scoped(operation: str, sandbox_id: str, key: str | None) -> str | None:
    return None if key is None else f"{operation}:{sandbox_id}:{key}"


def _fingerprint(body: BaseModel) -> str:
    """What a request asks for, its idempotency key aside: the same key must come with the same request.
    Keys sorted (a retry may reorder them); ASCII escapes so a lone surrogate hashes instead of raising."""
    wanted = body.model_dump(exclude={"idempotency_key"})
    return hashlib.sha256(json.dumps(wanted, sort_keys=True, ensure_ascii=True).encode()).hexdigest()


def _parse_failure(cause: BaseException) -> str:
    if isinstance(cause, RecursionError):
        return "nested deeper than the JSON decoder allows"
    if isinstance(cause, UnicodeDecodeError):
        return "the body is not UTF-8"
    return type(cause).__name__


def _text(value: str, what: str) -> str:
    """Refuse text that cannot become UTF-8 bytes (a lone UTF-16 surrogate sent as an escape)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(400, "invalid_encoding", f"{what} is not valid Unicode text: {exc.reason} "
                       f"at position {exc.start}") from None
    return value


def _argv(command: str | list[str]) -> list[str]:
    if isinstance(command, str):
        if not command.strip():
            raise ApiError(400, "invalid_request", "command is empty")
        argv = ["/bin/sh", "-c", command]
    else:
        if not command:
            raise ApiError(400, "invalid_request", "command argv is empty")
        argv = list(command)
        if "=" in argv[0]:
            raise ApiError(400, "invalid_request", f"argv[0] {argv[0][:80]!r} contains '='; name a program")
    for arg in argv:
        _text(arg, "command")
    if any("\0" in arg for arg in argv):
        raise ApiError(400, "invalid_request", "command contains a NUL byte")
    return argv


# Linux refuses one argument or variable over 128 KiB (MAX_ARG_STRLEN) and all of them together
# over a quarter of the stack limit (2 MiB by default): refuse before exec with a typed 413.
_MAX_ARG_BYTES = 128 * 1024 - 1
_MAX_ARGS_TOTAL_BYTES = 1 << 20


def _check_exec_size(argv: list[str], env: dict[str, str]) -> None:
    items = [arg.encode() for arg in argv] + [f"{name}={value}".encode() for name, value in env.items()]
    longest = max((len(item) for item in items), default=0)
    if longest > _MAX_ARG_BYTES:
        raise ApiError(413, "payload_too_large", f"a command argument or environment variable has {longest} bytes; "
                       f"the limit is {_MAX_ARG_BYTES} (pass big input on stdin or in a file)")
    total = sum(len(item) + 1 for item in items)
    if total > _MAX_ARGS_TOTAL_BYTES:
        raise ApiError(413, "payload_too_large", f"command and environment have {total} bytes; the limit is "
                       f"{_MAX_ARGS_TOTAL_BYTES} (pass big input on stdin or in a file)")


def _check_pair_spec_size(argv: list[str], peer: list[str], env: dict[str, str]) -> None:
    """With a peer, the command, the peer and the environment reach the pair launcher as one argument
    (:func:`~sandbox_server.isolation.pair_spec_arg`), under the same 128 KiB cap as any argument; 4 KiB
    are left for the service's own variables and the uids."""
    size = len(pair_spec_arg({"command": argv, "peer": peer, "env": env})) + 4096
    if size > _MAX_ARG_BYTES:
        raise ApiError(413, "payload_too_large", f"with a peer_command, the command, the peer and the environment "
                       f"travel as one argument of {size} bytes; the limit is {_MAX_ARG_BYTES} (pass big input on "
                       "stdin or in a file)")


def _env(env: dict[str, str]) -> dict[str, str]:
    for name, value in env.items():
        _text(name, "an environment variable name")
        _text(value, f"environment variable {name}")
        if not _ENV_NAME.match(name):
            raise ApiError(400, "invalid_request", f"invalid environment variable name {name[:80]!r}")
        if refused_env_name(name):
            raise ApiError(400, "env_refused", f"environment variable {name} configures the loader or libc "
                           "and is refused (LD_*, GCONV_PATH, LOCPATH, ...)")
        if "\0" in value:
            raise ApiError(400, "invalid_request", f"environment variable {name} contains a NUL byte")
    return env
