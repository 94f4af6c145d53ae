"""An exec's ``gateway_url``: the command reaches that URL's path, at ``http://127.0.0.1:PORT/PATH`` inside its
sandbox, and nothing else, whatever it writes on the connection (sandbox_server/gateway_proxy.py)."""

from __future__ import annotations

import asyncio
import doctest
import http.server
import json
import socketserver
import threading

import pytest

from sandbox_client import SandboxClient, SandboxRequestError
from sandbox_server import gateway_proxy
from sandbox_server.launch import start_local_server

# Raw HTTP written by a hostile command, each on a fresh connection to the forwarder; the upstream records every
# path it is asked for.
PROBE = r"""
import json, socket, sys
port = int(sys.argv[1])
def raw(data, path="/run/gateway/gateway.sock"):
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM) if path is None else socket.socket(socket.AF_UNIX)
    s.connect(("127.0.0.1", port) if path is None else path)
    s.sendall(data)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out.split(b"\r\n", 1)[0].decode()
results = {
    "own": raw(b"GET /episodes/e1/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", None),
    "pipelined": raw(b"GET /episodes/e1/v1/a HTTP/1.1\r\nHost: x\r\n\r\nGET /episodes/e2/v1/b HTTP/1.1\r\nHost: x\r\n\r\n", None),
    "other": raw(b"GET /episodes/e2/v1/models HTTP/1.1\r\n\r\n"),
    "dots": raw(b"GET /episodes/e1/../e2/v1/models HTTP/1.1\r\n\r\n"),
    "escaped": raw(b"GET /episodes/e1/%2e%2e/e2/v1 HTTP/1.1\r\n\r\n"),
    "absolute": raw(b"GET http://127.0.0.1/episodes/e1/v1/models HTTP/1.1\r\n\r\n"),
    "chunked": raw(b"POST /episodes/e1/v1/x HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n"),
}
print(json.dumps(results))
"""


class _Upstream(http.server.BaseHTTPRequestHandler):
    paths: list[str] = []

    def do_GET(self):
        _Upstream.paths.append(self.path)
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def upstream():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _Upstream.paths = []
    yield server.server_address[1]
    server.shutdown()


def test_a_command_reaches_only_its_gateway_urls_path_whatever_it_writes(upstream, tmp_path):
    with start_local_server(log_file=tmp_path / "server.log") as server:
        if server.health()["isolation"]["backend"] != "bwrap":
            pytest.skip("gateway_url needs bwrap isolation (refused otherwise: the next test)")

        async def main():
            async with SandboxClient(server.url, server.token) as client:
                sid = await client.create({})
                url = f"http://127.0.0.1:{upstream}/episodes/e1/v1"
                result = await client.exec(sid, ["python", "-c", PROBE, str(upstream)], gateway_url=url, timeout_s=30)
                networked = await client.create({}, network=True)
                with pytest.raises(SandboxRequestError, match="created without network"):
                    await client.exec(networked, "true", gateway_url=url)
                with pytest.raises(SandboxRequestError, match="gateway_url must be http"):
                    await client.exec(sid, "true", gateway_url="https://127.0.0.1:1/episodes/e1/v1")
                exit_code = (await client.exec(sid, "exit 7", gateway_url=url)).exit_code
                return result, exit_code

        result, exit_code = asyncio.run(main())
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == {
        "own": "HTTP/1.0 200 OK", "pipelined": "HTTP/1.0 200 OK", "other": "HTTP/1.1 403 Forbidden",
        "dots": "HTTP/1.1 403 Forbidden", "escaped": "HTTP/1.1 403 Forbidden", "absolute": "HTTP/1.1 403 Forbidden",
        "chunked": "HTTP/1.1 411 Length Required"}
    assert _Upstream.paths == ["/episodes/e1/v1/models", "/episodes/e1/v1/a"]  # the pipelined second never left
    assert exit_code == 7  # the forwarder exits with the command's status


def test_the_gateway_proxys_rules_hold_as_documented():
    assert doctest.testmod(gateway_proxy, raise_on_error=False, verbose=False).failed == 0


def test_the_proxy_bounds_the_bodies_it_holds_and_drops_them_with_the_exec(upstream, tmp_path):
    """A body past the limit is answered 413 unread; stalled bodies hold at most 16 MiB per exec (past it 429);
    the exec's end releases them."""
    limit = gateway_proxy.MAX_BODY_BYTES
    head = b"POST /episodes/e1/v1/chat/completions HTTP/1.1\r\nContent-Length: %d\r\n\r\n"

    async def send(data: bytes):
        reader, writer = await asyncio.open_unix_connection(str(tmp_path / "gw" / gateway_proxy.SOCKET_NAME))
        writer.write(data)
        await writer.drain()
        return reader, writer

    async def main():
        async with gateway_proxy.GatewayProxy(f"http://127.0.0.1:{upstream}/episodes/e1/v1", tmp_path / "gw") as proxy:
            reader, _ = await send(head % (limit + 1))
            oversized = await reader.read()
            stalled = [await send(head % limit + b"x" * (limit - 1)) for _ in range(4)]  # one byte short each
            await asyncio.sleep(0.5)
            held = proxy._buffered
            late_reader, late_writer = await send(head % 10)
            refused = await asyncio.wait_for(late_reader.read(), 5)
            del stalled, late_writer  # held open until here
        await asyncio.sleep(0.1)
        return oversized, held, refused, proxy._buffered, len(proxy._tasks)

    oversized, held, refused, after, tasks = asyncio.run(main())
    assert oversized.startswith(b"HTTP/1.1 413 ") and json.loads(oversized.split(b"\r\n\r\n", 1)[1])["error"]["code"] \
        == "request_too_large"
    assert held == 4 * limit == 16 << 20 and refused.startswith(b"HTTP/1.1 429 ")
    assert (after, tasks) == (0, 0)
