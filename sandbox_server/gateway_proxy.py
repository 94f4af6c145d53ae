"""One URL, and nothing else, reachable from inside a sandbox: an exec's ``gateway_url``.

A coding harness run in a sandbox (no network namespace of the host) must call its model, and only its own
episode's model endpoint. Two pieces, on either side of the namespace wall:

- :class:`GatewayProxy` (server side) listens on a Unix socket in a folder bound into the sandbox at
  :data:`SOCKET_DIR`. Each connection carries one HTTP request whose path must stay under the URL's path (an
  episode's ``/episodes/<id>/``): anything else (another episode's URL, a path with ``..`` or escapes, a
  request without ``Content-Length``) is answered 403/411 here and never leaves. The request goes to the
  URL's host with ``Connection: close`` and the answer is piped back, streamed as it comes.
- :data:`FORWARD_SOURCE` (``loopback_forward.py``, in the sandbox) is the command's parent: it listens on
  ``127.0.0.1:<the URL's port>`` in the sandbox's own loopback, pipes each connection to the socket, starts
  the command, and exits with its status. An HTTP client inside uses ``http://127.0.0.1:PORT/<path>`` as is.

The sandbox has no other route out (its network namespace holds only loopback), so external addresses and
the sandbox service's own port are unreachable from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import posixpath
import sys
from pathlib import Path
from urllib.parse import unquote, urlsplit

SOCKET_DIR = "/run/gateway"
"""Where the proxy's folder is bound inside the sandbox; its socket is ``SOCKET_DIR/gateway.sock``."""
SOCKET_NAME = "gateway.sock"
FORWARD_SOURCE = (Path(__file__).resolve().parent / "loopback_forward.py").read_text(encoding="utf-8")
_MAX_HEAD_BYTES = 64 << 10
MAX_BODY_BYTES = 4 << 20
"""A request body's limit: a chat request past a long context's worth of text (the gateway keeps the same)."""
_MAX_BUFFERED_BYTES = 16 << 20  # of bodies held at once per exec: a few requests at the limit, never more
_HEAD_TIMEOUT_S = 60.0
_MAX_CONNECTIONS = 16  # open at once per exec: a harness makes a few; each may hold a 64 KiB head buffer
_HOP_HEADERS = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"upgrade", b"host"})


class GatewayUrlError(ValueError):
    """A ``gateway_url`` the service cannot forward to (not ``http://HOST:PORT/PATH/``)."""


def parse_gateway_url(url: str) -> tuple[str, int, str]:
    """``(host, port, path prefix)`` of ``url``, the prefix ending in ``/``.

    >>> parse_gateway_url("http://127.0.0.1:8123/episodes/g0-e1/v1")
    ('127.0.0.1', 8123, '/episodes/g0-e1/')
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.hostname or parts.port is None or parts.query or parts.fragment:
        raise GatewayUrlError(f"gateway_url must be http://HOST:PORT/PATH, got {url[:200]!r}")
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):  # the episode's root: its /v1 and any sibling route of the same episode
        path = path[: -len("/v1")]
    if not path or not _clean_path(path + "/") or path.count("/") < 1:
        raise GatewayUrlError(f"gateway_url needs a path naming one endpoint (e.g. /episodes/ID/v1), got {url[:200]!r}")
    return parts.hostname, parts.port, path + "/"


def _clean_path(path: str) -> bool:
    """A path with no escapes, dot segments or doubled slashes: what the proxy compares is what is routed."""
    return "%" not in path and "\\" not in path and unquote(path) == path and posixpath.normpath(path) + "/" in (
        path, path + "/")


def allowed_target(target: bytes, prefix: str) -> bool:
    """Whether a request line's target stays under ``prefix``.

    >>> p = "/episodes/a/"
    >>> [allowed_target(t, p) for t in (b"/episodes/a/v1/models", b"/episodes/b/v1/models",
    ...                                  b"/episodes/a/../b/v1/models", b"http://x/episodes/a/v1", b"/episodes/a%2f..")]
    [True, False, False, False, False]
    """
    try:
        text = target.decode("ascii")
    except UnicodeDecodeError:
        return False
    path = text.split("?", 1)[0]
    return path.startswith(prefix) and _clean_path(path)


def _answer(status: int, reason: str, message: str) -> bytes:
    code = {413: "request_too_large", 429: "rate_limit_exceeded"}.get(status, "forbidden")
    body = json.dumps({"error": {"message": message, "type": "invalid_request_error", "code": code,
                                 "param": None}}).encode()
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            f"Connection: close\r\n\r\n").encode() + body


class GatewayProxy:
    """The server side of one exec's gateway: ``async with GatewayProxy(url, folder):`` serves the socket
    ``folder/gateway.sock`` (mode 0666: the sandbox's uid connects) until the block ends."""

    def __init__(self, url: str, folder: Path) -> None:
        self.host, self.port, self.prefix = parse_gateway_url(url)
        self.folder = folder
        self._server: asyncio.AbstractServer | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task] = set()
        self._buffered = 0  # bytes of request bodies held now

    async def __aenter__(self) -> GatewayProxy:
        self.folder.mkdir(mode=0o755, exist_ok=True)
        self.folder.chmod(0o755)
        path = self.folder / SOCKET_NAME
        self._server = await asyncio.start_unix_server(self._serve, path=str(path), limit=_MAX_HEAD_BYTES)
        path.chmod(0o666)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._open):  # a harness killed mid-call leaves its connection open
            writer.close()
        for task in list(self._tasks):  # and a body half sent: its buffer goes with the exec
            task.cancel()
        with contextlib.suppress(OSError):
            (self.folder / SOCKET_NAME).unlink()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._open) >= _MAX_CONNECTIONS:
            writer.close()
            return
        self._open.add(writer)
        self._tasks.add(asyncio.current_task())
        try:
            request = await self._read_request(reader)
            if isinstance(request, bytes):
                try:
                    await self._forward(request, writer)
                finally:
                    self._buffered -= len(request) - request.index(b"\r\n\r\n") - 4
            else:
                writer.write(_answer(*request))
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ValueError,
                asyncio.CancelledError):
            pass  # the sandbox side hung up or sent garbage, or the exec ended (__aexit__): nothing to answer
        finally:
            self._open.discard(writer)
            self._tasks.discard(asyncio.current_task())
            writer.close()

    async def _read_request(self, reader: asyncio.StreamReader) -> bytes | tuple[int, str, str]:
        """The request to send on (head rewritten, body whole), or the refusal ``(status, reason, message)``."""
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _HEAD_TIMEOUT_S)
        line, *lines = head[:-4].split(b"\r\n")
        method, target, version = (line.split(b" ") + [b"", b""])[:3]
        if not allowed_target(target, self.prefix) or not version.startswith(b"HTTP/1."):
            return 403, "Forbidden", f"only this episode's endpoint ({self.prefix}...) is reachable from the sandbox"
        headers = [h for h in lines if h.split(b":", 1)[0].strip().lower() not in _HOP_HEADERS]
        names = {h.split(b":", 1)[0].strip().lower(): h.split(b":", 1)[-1].strip() for h in headers}
        if b"transfer-encoding" in names:
            return 411, "Length Required", "send the body with a Content-Length"
        length = int(names.get(b"content-length", b"0") or b"0")
        if not 0 <= length <= MAX_BODY_BYTES:
            return 413, "Payload Too Large", f"request bodies are limited to {MAX_BODY_BYTES} bytes"
        if self._buffered + length > _MAX_BUFFERED_BYTES:
            return 429, "Too Many Requests", f"other requests of this sandbox hold {self._buffered} bytes of bodies"
        self._buffered += length  # until the request is sent on (_serve)
        try:
            body = await asyncio.wait_for(reader.readexactly(length), _HEAD_TIMEOUT_S)
        except BaseException:
            self._buffered -= length
            raise
        host = f"Host: {self.host}:{self.port}".encode()
        return b"\r\n".join([b" ".join([method, target, b"HTTP/1.1"]), host, *headers, b"Connection: close"]) + \
            b"\r\n\r\n" + body

    async def _forward(self, request: bytes, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError as err:
            writer.write(_answer(502, "Bad Gateway", f"the gateway does not answer: {err}"))
            await writer.drain()
            return
        try:
            up_writer.write(request)
            await up_writer.drain()
            while chunk := await up_reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        finally:
            up_writer.close()


def forward_argv(argv: list[str], port: int) -> list[str]:
    """``argv`` started by the in-sandbox forwarder, which serves ``127.0.0.1:port`` for it."""
    return [sys.executable, "-I", "-S", "-c", FORWARD_SOURCE, str(port), f"{SOCKET_DIR}/{SOCKET_NAME}", *argv]
