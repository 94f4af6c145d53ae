"""The reference server under faults: lost responses, a killed server, a full server, leaked sandboxes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

import httpx2
import pytest

from sandbox_client import SandboxCapacityError, SandboxClient, SandboxInfraError, SandboxRequestError
from sandbox_server.launch import start_local_server


class DropFirstResponses:
    """Loopback TCP proxy that forwards requests but swallows the next ``num_drops`` answers and resets
    the connection instead: the request ran, the client never heard back."""

    def __init__(self, upstream_port: int, num_drops: int) -> None:
        self.upstream_port = upstream_port
        self.num_drops = num_drops
        self.port = 0

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        self._server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream_port)

        async def forward_requests():
            with contextlib.suppress(ConnectionError):
                while data := await reader.read(65536):
                    up_writer.write(data)
                    await up_writer.drain()

        async def relay_responses():
            with contextlib.suppress(ConnectionError):
                while data := await up_reader.read(65536):
                    if self.num_drops > 0:  # the upstream answered: reset the client instead of relaying
                        self.num_drops -= 1
                        writer.transport.abort()
                        return
                    writer.write(data)
                    await writer.drain()

        relay = asyncio.create_task(relay_responses())
        await forward_requests()
        await relay
        up_writer.close()
        writer.close()


def test_exec_whose_response_is_lost_runs_exactly_once():
    with start_local_server() as server:
        port = int(server.url.rsplit(":", 1)[1])

        async def main():
            proxy = DropFirstResponses(port, num_drops=0)
            await proxy.start()
            async with SandboxClient(f"http://127.0.0.1:{proxy.port}", server.token, backoff_s=0.01) as client:
                sid = await client.create({})
                proxy.num_drops = 2
                result = await client.exec(sid, "echo run >> count.txt; wc -l < count.txt")
                assert result.stdout.strip() == "1"
                assert proxy.num_drops == 0  # both answers were lost: the exec was sent three times
                assert await client.read_file(sid, "count.txt") == "run\n"
                await client.delete(sid)
            await proxy.stop()

        asyncio.run(main())


def _pids_with(marker: str) -> list[int]:
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
    return pids


def test_server_killed_mid_exec_is_an_infra_error_and_leaks_no_process():
    marker = f"leakcheck-{uuid.uuid4().hex}"
    with start_local_server() as server:

        async def main():
            async with SandboxClient(server.url, server.token, max_retries=2, backoff_s=0.05) as client:
                sid = await client.create({})
                running = asyncio.create_task(
                    client.exec(sid, ["python", "-c", "import time; time.sleep(60)", marker], timeout_s=60))
                for _ in range(100):
                    await asyncio.sleep(0.05)
                    if _pids_with(marker):
                        break
                assert _pids_with(marker), "the command never started"
                os.kill(server.process.pid, signal.SIGKILL)
                start = time.monotonic()
                with pytest.raises(SandboxInfraError):
                    await running
                assert time.monotonic() - start < 10
                with pytest.raises(SandboxInfraError):
                    await client.exec(sid, "true")

        asyncio.run(main())
    deadline = time.monotonic() + 5
    while _pids_with(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _pids_with(marker) == []


def test_full_server_answers_429_and_leaked_sandboxes_are_reaped(tmp_path):
    with start_local_server(max_sandboxes=2, default_ttl_s=1.0, reap_interval_s=0.2, capacity_retry_after_s=1,
                            root_dir=str(tmp_path / "boxes")) as server:
        headers = {"Authorization": f"Bearer {server.token}"}
        first = httpx2.post(f"{server.url}/v1/sandboxes", json={}, headers=headers).json()["id"]
        httpx2.post(f"{server.url}/v1/sandboxes", json={}, headers=headers).raise_for_status()
        full = httpx2.post(f"{server.url}/v1/sandboxes", json={}, headers=headers)
        assert full.status_code == 429 and full.headers["retry-after"] == "1"
        assert full.json()["error"]["code"] == "capacity"

        async def create_when_full():
            async with SandboxClient(server.url, server.token, max_retries=0) as client:
                await client.create({})

        with pytest.raises(SandboxCapacityError):
            asyncio.run(create_when_full())
        # Nobody deletes them: the reaper does, after the idle TTL.
        deadline = time.monotonic() + 5
        while server.health()["sandboxes"]["active"] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.health()["sandboxes"]["active"] == 0
        assert not (tmp_path / "boxes" / first).exists()
        metrics = httpx2.get(f"{server.url}/v1/metrics", headers=headers).text
        assert 'sandbox_deleted_total{reason="reaped"} 2.0' in metrics
        assert "sandbox_create_rejected_total 2.0" in metrics  # the raw request and the client


def test_launcher_keeps_the_token_out_of_argv_and_logs_and_cleans_up(tmp_path):
    log_file = tmp_path / "server.log"
    with start_local_server(root_dir=str(tmp_path / "boxes"), log_file=log_file) as server:
        cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
        assert server.token.encode() not in cmdline and len(server.token) >= 32
        assert httpx2.get(f"{server.url}/v1/health").status_code == 401
        headers = {"Authorization": f"Bearer {server.token}"}
        httpx2.post(f"{server.url}/v1/sandboxes", json={}, headers=headers).raise_for_status()
        assert len(_sandbox_dirs(tmp_path / "boxes")) == 1
    assert server.process.poll() is not None
    assert _sandbox_dirs(tmp_path / "boxes") == []  # graceful stop removed the workspaces
    assert server.token not in log_file.read_text()
    with pytest.raises(ValueError, match="unknown sandbox server options"):
        start_local_server(max_sandbox=3)


def test_every_option_is_a_documented_flag_and_an_environment_variable(tmp_path, monkeypatch, capsys):
    from sandbox_server.__main__ import parse
    from sandbox_server.options import ServerOptions

    with pytest.raises(SystemExit):
        parse(["--help"])
    help_text = capsys.readouterr().out
    flat = "".join(help_text.split())  # argparse wraps lines, also at hyphens
    for name, field in ServerOptions.model_fields.items():
        assert f"--{name.replace('_', '-')}" in help_text
        assert "".join(field.description.split()) in flat  # the field's docstring is its help
    with pytest.raises(SystemExit, match=r"default_ttl_s \(10.0\) exceeds max_ttl_s \(5.0\)") as refused:
        parse(["--max-ttl-s", "5", "--default-ttl-s", "10", "--token", "secret-token-value"])
    assert "secret-token-value" not in str(refused.value)  # the refusal never echoes the token
    # a variable configures a server started by hand (a flag wins over it)
    monkeypatch.setenv("SANDBOX_SERVER_MAX_SANDBOXES", "3")
    monkeypatch.setenv("SANDBOX_SERVER_TOKEN", "t")
    assert parse([])[1].max_sandboxes == 3
    assert parse(["--max-sandboxes", "5"])[1].max_sandboxes == 5


def _sandbox_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if not p.name.startswith(".")]  # .lock marks the root as taken


def test_a_launched_server_ignores_the_callers_sandbox_server_variables(monkeypatch):
    """The trainer's own server is configured by the options passed to it only: inherited
    SANDBOX_SERVER_* variables (for a server the user starts by hand) change nothing."""
    monkeypatch.setenv("SANDBOX_SERVER_MAX_SANDBOXES", "1")
    monkeypatch.setenv("SANDBOX_SERVER_OUTPUT_LIMIT_BYTES", "10")
    with start_local_server(max_sandboxes=3) as server:
        health = server.health()
    assert health["sandboxes"]["max"] == 3
    assert health["limits"]["output_limit_bytes"] != 10


def _kept_answer_bytes(url: str, headers: dict) -> float:
    metrics = httpx2.get(f"{url}/v1/metrics", headers=headers).text
    return float(next(line.split()[1] for line in metrics.splitlines() if line.startswith("sandbox_idempotency_bytes")))


def test_kept_answers_are_bounded_per_sandbox_and_in_total_and_go_with_their_sandbox():
    """Each exec answer is kept for retries, but within a byte budget: per sandbox (its oldest answer
    goes first), in total, and not past the sandbox's deletion. A retry whose answer was dropped is a
    typed 410 and does not run the command again."""
    from sandbox_server.options import largest_exec_answer_bytes

    limit = 32 << 10
    per_box = largest_exec_answer_bytes(limit)  # room for one worst-case answer
    flood = f"echo run >> runs.txt; head -c {limit} /dev/zero; head -c {limit} /dev/zero >&2"
    with start_local_server(output_limit_bytes=limit, idempotency_max_bytes_per_sandbox=per_box,
                            idempotency_max_bytes=per_box * 3 // 2) as server:
        headers = {"Authorization": f"Bearer {server.token}"}
        http = httpx2.Client(base_url=server.url, headers=headers, timeout=60)
        boxes = [http.post("/v1/sandboxes", json={}).json()["id"] for _ in range(2)]
        first, second = ({"command": flood, "idempotency_key": uuid.uuid4().hex} for _ in range(2))
        answers = [http.post(f"/v1/sandboxes/{boxes[0]}/exec", json=body) for body in (first, second)]
        assert all(len(a.content) > per_box // 2 for a in answers)  # NULs: 6 bytes each in JSON
        assert _kept_answer_bytes(server.url, headers) <= per_box
        dropped = http.post(f"/v1/sandboxes/{boxes[0]}/exec", json=first)
        assert (dropped.status_code, dropped.json()["error"]["code"]) == (410, "answer_dropped")
        assert http.post(f"/v1/sandboxes/{boxes[0]}/exec", json=second).content == answers[1].content
        assert http.get(f"/v1/sandboxes/{boxes[0]}/file", params={"path": "runs.txt"}).json()["content"] == "run\nrun\n"
        http.post(f"/v1/sandboxes/{boxes[1]}/exec", json={"command": flood, "idempotency_key": "k"})
        assert _kept_answer_bytes(server.url, headers) <= per_box * 3 // 2
        for sid in boxes:
            http.delete(f"/v1/sandboxes/{sid}").raise_for_status()
        assert _kept_answer_bytes(server.url, headers) == 0


def test_a_workspace_too_slow_to_fork_is_refused_typed_leaves_nothing_and_scores_zero(tmp_path):
    """A fork not done within fork_timeout_s (or the client's wait, if shorter) is discarded and answered
    422 snapshot_too_slow: no fork is made after its client gave up, and scoring gives the submission 0
    with the reason (the agent made its workspace that slow), not an infrastructure error."""
    from sandbox_client import score_submission

    make_tree = "import os\nfor i in range(600):\n    os.makedirs(f'w/{i}/' + '/'.join('abcdefghij'))\n"
    with start_local_server(fork_timeout_s=0.02, root_dir=str(tmp_path / "boxes")) as server:

        async def main():
            async with SandboxClient(server.url, server.token) as client:
                agent = await client.create({"utils.py": "def f():\n    return 1\n"})
                await client.exec(agent, ["python", "-c", make_tree], timeout_s=60)
                with pytest.raises(SandboxRequestError) as refused:
                    await client.fork(agent)
                score = await score_submission(client, task_files={"utils.py": ""}, agent_sandbox_id=agent,
                                               hidden_files={"hidden/test_h.py": "def test_h():\n    pass\n"},
                                               test_command="python -m pytest -q hidden", timeout_s=30)
                live = (await client.health())["sandboxes"]["active"], len(_sandbox_dirs(tmp_path / "boxes"))
                await client.delete(agent)
                return refused.value, score, live

        refused, score, live = asyncio.run(main())
        assert (refused.status, refused.code) == (422, "snapshot_too_slow")
        assert live == (1, 1)  # the agent's sandbox only: neither refused copy (the test's, scoring's) is left
        assert score.reward == 0.0 and "snapshot_too_slow" in score.output, score
        assert score.unscorable  # the episode ends unscorable_workspace, not sandbox_error


def _closed_by_server(socks: list, wait_s: float) -> int:
    """How many of ``socks`` the server closed within ``wait_s`` (all watched at once)."""
    import selectors

    closed, deadline = set(), time.monotonic() + wait_s
    with selectors.DefaultSelector() as selector:
        for sock in socks:
            selector.register(sock, selectors.EVENT_READ)
        while len(closed) < len(socks) and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                try:
                    data = key.fileobj.recv(1 << 16)
                except (ConnectionResetError, BrokenPipeError):
                    data = b""
                if data == b"":
                    closed.add(key.fileobj)
                    selector.unregister(key.fileobj)
    return len(closed)


def test_half_sent_requests_are_bounded_per_client_and_in_time():
    """A client cannot hold connections open with requests the server cannot yet authenticate: past
    max_connections_per_client they are closed at once, a request whose headers are not complete
    within header_timeout_s is closed, a body not complete within body_timeout_s is a 408."""
    import socket

    with start_local_server(header_timeout_s=1.0, body_timeout_s=1.0, max_connections_per_client=10) as server:
        port = int(server.url.rsplit(":", 1)[1])
        half_sent = []
        for _ in range(15):
            sock = socket.create_connection(("127.0.0.1", port))
            sock.sendall(b"POST /v1/sandboxes HTTP/1.1\r\nHost: x\r\n")  # headers never finished
            half_sent.append(sock)
        assert _closed_by_server(half_sent, 0.5) == 5  # past the cap: closed at once
        assert _closed_by_server(half_sent, 3.0) == 15  # the header deadline closed the rest
        assert server.health()["status"] == "ok"  # the server answers again once they are gone
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(f"PUT /v1/sandboxes/{'0' * 32}/file HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                         f"{server.token}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{{".encode())
            sock.settimeout(5)
            started = time.monotonic()
            answer = b""
            while chunk := sock.recv(1 << 16):  # the server closes after its answer (headers and body may part)
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
            assert time.monotonic() - started < 4
        for sock in half_sent:
            sock.close()


def test_a_retry_whose_answer_was_dropped_raises_the_typed_error_and_does_not_run_again():
    """The client's side of the answer budget: an exec whose answer was lost in transit and, before its
    retry, pushed out of the sandbox's budget by a later exec's answer raises SandboxAnswerDropped (an
    infrastructure error) and ran once."""
    from sandbox_client import SandboxAnswerDropped
    from sandbox_server.options import largest_exec_answer_bytes

    limit = 32 << 10
    nuls = f"head -c {limit} /dev/zero; head -c {limit} /dev/zero >&2"
    with start_local_server(output_limit_bytes=limit,
                            idempotency_max_bytes_per_sandbox=largest_exec_answer_bytes(limit)) as server:
        port = int(server.url.rsplit(":", 1)[1])

        async def main():
            proxy = DropFirstResponses(port, num_drops=0)
            await proxy.start()
            async with SandboxClient(f"http://127.0.0.1:{proxy.port}", server.token, backoff_s=4.0) as client:
                sid = await client.create({})
                proxy.num_drops = 1  # the first answer: the first exec's
                first = asyncio.create_task(client.exec(sid, f"echo a >> runs.txt; {nuls}"))
                await asyncio.sleep(0.5)
                await client.exec(sid, nuls)  # its answer pushes the first one's out, before the retry
                with pytest.raises(SandboxAnswerDropped) as dropped:
                    await first
                runs = await client.read_file(sid, "runs.txt")
                await client.delete(sid)
            await proxy.stop()
            return dropped.value, runs

        dropped, runs = asyncio.run(main())
    assert (dropped.status, dropped.code) == (410, "answer_dropped") and isinstance(dropped, SandboxInfraError)
    assert runs == "a\n"


def test_a_fork_cut_by_the_clients_wait_is_the_service_busy_not_the_agents_slow_workspace(tmp_path):
    """The agent is charged with fork_timeout_s of copying from when its copy starts; a copy cut by the client's
    own shorter wait (a queue behind other sandboxes' copies, a busy host) is 503 service_busy: retried, then an
    infrastructure error, never 422 snapshot_too_slow (which scores the submission 0)."""
    make_tree = "import os\nfor i in range(600):\n    os.makedirs(f'w/{i}/' + '/'.join('abcdefghij'))\n"
    with start_local_server(fork_timeout_s=25.0, root_dir=str(tmp_path / "boxes")) as server:

        async def main():
            async with SandboxClient(server.url, server.token) as setup:
                agent = await setup.create({"utils.py": "def f():\n    return 1\n"})
                await setup.exec(agent, ["python", "-c", make_tree], timeout_s=60)
            # the server's side, read patiently: a copy cut at the 0.05 s the client said it waits is 503
            async with httpx2.AsyncClient(timeout=60) as raw:
                answer = await raw.post(f"{server.url}/v1/sandboxes/{agent}/fork",
                                        headers={"Authorization": f"Bearer {server.token}"},
                                        json={"idempotency_key": uuid.uuid4().hex, "timeout_s": 0.05})
            # the client's side: it waits 0.1 s an attempt (and tells the server 0.05 s); on a loaded host the
            # 503 itself may arrive after that, so the error is either retried 503s or a timeout: infrastructure
            async with SandboxClient(server.url, server.token, timeout_s=0.1, max_retries=1, backoff_s=0.01) as hasty:
                with pytest.raises(SandboxInfraError) as busy:
                    await hasty.fork(agent)
            async with SandboxClient(server.url, server.token) as client:
                live = len(_sandbox_dirs(tmp_path / "boxes"))
                await client.delete(agent)
            return answer, busy.value, live

        answer, busy, live = asyncio.run(main())
        assert answer.status_code == 503 and answer.json()["error"]["code"] == "service_busy", answer.text
        assert not isinstance(busy, SandboxRequestError), busy
        assert live == 1  # no copy left behind


PARENT = """
import asyncio, sys
from sandbox_client import SandboxClient
from sandbox_server.launch import start_local_server

async def main(server):
    async with SandboxClient(server.url, server.token, timeout_s=600) as client:
        box = await client.create({"a.txt": "x"})
        print(server.process.pid, flush=True)
        await client.exec(box, ["sh", "-c", "sleep " + sys.argv[1]], timeout_s=500)

with start_local_server() as server:
    asyncio.run(main(server))
"""


def test_a_local_server_and_its_sandboxes_go_within_seconds_of_a_killed_parent(tmp_path):
    """A trainer killed by SIGKILL leaves no server (parent pid 1) nor command behind: the server gets SIGTERM
    (PR_SET_PDEATHSIG) and stops at once, an exec in flight or not."""
    import subprocess
    import sys

    marker = str(700000 + os.getpid() % 99999)  # this test's own sleep
    parent = subprocess.Popen([sys.executable, "-c", PARENT, marker], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    server_pid = int(parent.stdout.readline())

    def alive(pid: int) -> bool:
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
        except (OSError, IndexError):
            return False

    def sleeping() -> bool:
        for p in Path("/proc").iterdir():
            with contextlib.suppress(OSError):
                if p.name.isdigit() and (p / "cmdline").read_bytes() == f"sleep\0{marker}\0".encode() and alive(int(p.name)):
                    return True
        return False

    deadline = time.monotonic() + 30
    while not sleeping() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sleeping()
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    while time.monotonic() - killed < 10 and (alive(server_pid) or sleeping()):
        time.sleep(0.1)
    gone_after = time.monotonic() - killed
    assert gone_after < 3.5 and not sleeping(), gone_after
