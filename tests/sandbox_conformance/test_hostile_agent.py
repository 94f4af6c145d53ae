"""A hostile agent against the service: each attack fails with a typed error or is contained, and the
server keeps answering everyone else meanwhile.

Each test names the guarantee it holds a server to; docs/sandbox.md says how the reference server keeps it.
"""

from __future__ import annotations

import json

import httpx
import pytest

from sandbox_client import SandboxRequestError

# Reads every visible process's argv and prints the absolute paths that do not exist in the sandbox's
# own view: a host path there (a bind source, the server's workspace root) tells the agent where its
# files live on the host.
_HOST_PATHS_IN_CMDLINES = r"""
import os
missing = set()
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        args = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\0')
    except OSError:
        continue
    for arg in args:
        text = arg.decode(errors='replace')
        for word in text.replace('=', ' ').replace(':', ' ').split():
            if word.startswith('/') and not os.path.lexists(word):
                missing.add(word)
print(sorted(missing))
"""


def _raw(endpoint, method: str, path: str, body: dict | None = None, **kwargs) -> httpx.Response:
    """A request sent as the JSON the body encodes to with ASCII escapes (so a lone surrogate travels)."""
    url, token = endpoint
    content = None if body is None else json.dumps(body).encode()
    return httpx.request(method, f"{url}{path}", content=content, timeout=30,
                         headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
                         **kwargs)


def _assert_error(response: httpx.Response, status: int, code: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["code"] == code, response.text


def _assert_still_serving(run):
    async def body(client):
        sid = await client.create({"ok.py": "print('alive')"})
        try:
            assert (await client.exec(sid, "python ok.py", timeout_s=30)).stdout == "alive\n"
        finally:
            await client.delete(sid)

    run(body)


@pytest.fixture
def sandbox(endpoint):
    response = _raw(endpoint, "POST", "/v1/sandboxes", {"files": {"a.txt": "a"}})
    assert response.status_code == 201, response.text
    sandbox_id = response.json()["id"]
    yield sandbox_id
    _raw(endpoint, "DELETE", f"/v1/sandboxes/{sandbox_id}")


# ---- 1. host root through env ------------------------------------------------------------------
@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "GCONV_PATH", "LOCPATH"])
def test_loader_variables_in_exec_env_are_refused_with_a_typed_400(endpoint, sandbox, name):
    response = _raw(endpoint, "POST", f"/v1/sandboxes/{sandbox}/exec",
                    {"command": "true", "env": {name: "/workspace/evil.so"}})
    _assert_error(response, 400, "env_refused")


def test_request_env_reaches_the_command_and_nothing_of_the_server_does(run):
    async def body(client):
        sid = await client.create({})
        try:
            result = await client.exec(sid, "echo \"$GREETING\"; env", env={"GREETING": "hello there"})
            assert result.exit_code == 0, result.stderr
            lines = result.stdout.splitlines()
            assert lines[0] == "hello there"
            names = {line.split("=", 1)[0] for line in lines[1:] if "=" in line}
            assert not names & {"SANDBOX_SERVER_TOKEN", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH"}
        finally:
            await client.delete(sid)

    run(body)


def test_no_process_argv_inside_the_sandbox_names_a_host_path(run, health):
    if "pid" not in " ".join(health["isolation"]["namespaces"]):
        pytest.skip("server reports no pid namespace: host processes are visible by design")

    async def body(client):
        sid = await client.create({"probe.py": _HOST_PATHS_IN_CMDLINES})
        try:
            result = await client.exec(sid, ["python", "probe.py"], timeout_s=30)
            assert result.exit_code == 0, result.stderr
            assert result.stdout.strip() == "[]"
        finally:
            await client.delete(sid)

    run(body)


# ---- 5. typed errors for text that is not Unicode ---------------------------------------------
def test_lone_surrogates_anywhere_in_a_request_get_a_typed_400(endpoint, sandbox, run):
    bad = "x\ud800y"
    exec_path = f"/v1/sandboxes/{sandbox}/exec"
    for body in ({"command": f"echo {bad}"}, {"command": ["echo", bad]}, {"command": "true", "env": {"V": bad}},
                 {"command": "cat", "stdin": bad}):
        _assert_error(_raw(endpoint, "POST", exec_path, body), 400, "invalid_encoding")
    for body in ({"path": "ok.txt", "content": bad}, {"path": f"{bad}.txt", "content": "ok"}):
        _assert_error(_raw(endpoint, "PUT", f"/v1/sandboxes/{sandbox}/file", body), 400, "invalid_encoding")
    _assert_error(_raw(endpoint, "POST", "/v1/sandboxes", {"files": {"a.py": bad}}), 400, "invalid_encoding")
    _assert_error(_raw(endpoint, "POST", "/v1/sandboxes", {"files": {bad: "x"}}), 400, "invalid_encoding")

    async def body(client):  # the client refuses before sending: a typed error, not UnicodeEncodeError
        with pytest.raises(SandboxRequestError) as caught:
            await client.write_file(sandbox, "ok.txt", bad)
        assert caught.value.code == "invalid_encoding"
        with pytest.raises(SandboxRequestError):
            await client.exec(sandbox, ["echo", bad])

    run(body)
    _assert_still_serving(run)
