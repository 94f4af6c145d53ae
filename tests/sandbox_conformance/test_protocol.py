"""Protocol v1: every call a trainer makes, against any conforming server."""

from __future__ import annotations

import uuid

import httpx2
import pytest

from sandbox_client import CommandTimeout, SandboxNotFound


def test_health_reports_protocol_isolation_and_limits(health):
    assert health["status"] == "ok"
    assert health["protocol"] == "v1"
    iso = health["isolation"]
    assert isinstance(iso["backend"], str) and iso["isolated"] and iso["not_isolated"]
    assert isinstance(iso["network_isolated_by_default"], bool)
    for key in ("output_limit_bytes", "max_request_bytes", "max_file_bytes", "max_timeout_s"):
        assert health["limits"][key] > 0


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/health"), ("GET", "/v1/metrics"), ("GET", "/v1/openapi.json"), ("POST", "/v1/sandboxes"),
    ("POST", "/v1/sandboxes/0123456789abcdef0123456789abcdef/exec"),
    ("GET", "/v1/sandboxes/0123456789abcdef0123456789abcdef/files"),
])
def test_every_endpoint_requires_the_bearer_token(endpoint, method, path):
    url, token = endpoint
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": token}):
        response = httpx2.request(method, url + path, headers=headers, json={}, timeout=30)
        assert response.status_code == 401, (headers, response.text)
        assert token not in response.text


def test_openapi_and_metrics_are_published(endpoint):
    url, token = endpoint
    headers = {"Authorization": f"Bearer {token}"}
    schema = httpx2.get(f"{url}/v1/openapi.json", headers=headers, timeout=30).json()
    assert "/v1/sandboxes/{sandbox_id}/exec" in schema["paths"]
    metrics = httpx2.get(f"{url}/v1/metrics", headers=headers, timeout=30)
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert "# TYPE" in metrics.text


def test_create_read_write_list_fork_delete_round_trip(run):
    async def body(client):
        sid = await client.create({"pkg/utils.py": "X = 1\n", "data.bin": b"\x00\xff\x10"})
        assert await client.list_files(sid) == ["data.bin", "pkg/utils.py"]
        assert await client.read_file(sid, "pkg/utils.py") == "X = 1\n"
        assert await client.read_bytes(sid, "data.bin") == b"\x00\xff\x10"
        await client.write_file(sid, "pkg/new/mod.py", "Y = 2\n")
        assert await client.read_file(sid, "pkg/new/mod.py") == "Y = 2\n"
        child = await client.fork(sid)
        await client.write_file(child, "pkg/utils.py", "X = 99\n")
        # The fork is a copy: edits do not flow either way.
        assert await client.read_file(sid, "pkg/utils.py") == "X = 1\n"
        assert await client.read_file(child, "pkg/new/mod.py") == "Y = 2\n"
        assert (await client.exec(child, "cat pkg/utils.py")).stdout == "X = 99\n"
        await client.delete(sid)
        await client.delete(child)
        with pytest.raises(SandboxNotFound):
            await client.list_files(sid)

    run(body)


def test_exec_shell_argv_stdin_env_and_nonzero_exit(run):
    async def body(client):
        sid = await client.create({})
        try:
            shell = await client.exec(sid, "echo $GREETING; echo err >&2; exit 3", env={"GREETING": "hi"})
            assert (shell.exit_code, shell.stdout, shell.stderr, shell.timed_out) == (3, "hi\n", "err\n", False)
            argv = await client.exec(sid, ["python", "-c", "import sys; print(sys.stdin.read()[::-1])"],
                                     stdin="abc")
            assert argv.stdout == "cba\n" and argv.exit_code == 0 and argv.duration_s >= 0
            missing = await client.exec(sid, "definitely-not-a-command-xyz")
            assert missing.exit_code == 127
        finally:
            await client.delete(sid)

    run(body)


def test_python_and_pytest_run_inside_the_sandbox(run):
    files = {
        "utils.py": "def add(a, b):\n    return a + b\n",
        "test_utils.py": "from utils import add\n\ndef test_add():\n    assert add(2, 2) == 4\n",
        "main.py": "import sys, utils\nprint(utils.add(1, 2), sys.version_info[:2])\n",
    }

    async def body(client):
        sid = await client.create(files)
        try:
            passing = await client.exec(sid, "python -m pytest -q", timeout_s=60)
            assert passing.exit_code == 0, passing.stdout + passing.stderr
            assert "1 passed" in passing.stdout
            script = await client.exec(sid, "python main.py")
            assert script.stdout.startswith("3 (3, ")
            await client.write_file(sid, "utils.py", "def add(a, b):\n    return a - b\n")
            failing = await client.exec(sid, "python -m pytest -q", timeout_s=60)
            assert failing.exit_code == 1 and "1 failed" in failing.stdout
        finally:
            await client.delete(sid)

    run(body)


def test_timeout_kills_the_whole_process_tree_and_daemons(run):
    async def body(client):
        import asyncio

        sid = await client.create({})
        try:
            # A daemon that detaches from the command and would write a file later.
            daemon = await client.exec(
                sid, "setsid sh -c 'sleep 2; echo late > daemon.txt' >/dev/null 2>&1 < /dev/null & echo started",
                timeout_s=10)
            assert daemon.stdout == "started\n" and daemon.duration_s < 2  # it did not wait for the daemon
            with pytest.raises(CommandTimeout) as caught:
                await client.exec(sid, "(sleep 1.5; echo late > child.txt) & echo partial; sleep 30", timeout_s=0.5)
            result = caught.value.result
            assert result.timed_out and result.stdout == "partial\n" and result.duration_s < 5
            await asyncio.sleep(2.5)
            assert "child.txt" not in await client.list_files(sid)
            assert "daemon.txt" not in await client.list_files(sid)
        finally:
            await client.delete(sid)

    run(body)


def test_exec_idempotency_key_runs_a_command_once(endpoint):
    url, token = endpoint
    headers = {"Authorization": f"Bearer {token}"}
    with httpx2.Client(base_url=url, headers=headers, timeout=30) as http:
        sid = http.post("/v1/sandboxes", json={"files": {}}).json()["id"]
        try:
            key = uuid.uuid4().hex
            body = {"command": "echo run >> count.txt; wc -l < count.txt", "idempotency_key": key}
            first = http.post(f"/v1/sandboxes/{sid}/exec", json=body).json()
            second = http.post(f"/v1/sandboxes/{sid}/exec", json=body).json()
            assert first == second and first["stdout"].strip() == "1"
            other = http.post(f"/v1/sandboxes/{sid}/exec", json={**body, "idempotency_key": uuid.uuid4().hex})
            assert other.json()["stdout"].strip() == "2"
        finally:
            http.delete(f"/v1/sandboxes/{sid}")


def test_unknown_sandbox_ids_are_not_found(run):
    async def body(client):
        for bad in ("0123456789abcdef0123456789abcdef", "nope", "..%2F.."):
            with pytest.raises(SandboxNotFound):
                await client.exec(bad, "true")
            with pytest.raises(SandboxNotFound):
                await client.read_file(bad, "a.py")
            with pytest.raises(SandboxNotFound):
                await client.fork(bad)
        with pytest.raises(SandboxNotFound):
            await client.delete("0123456789abcdef0123456789abcdef")

    run(body, max_retries=0)
