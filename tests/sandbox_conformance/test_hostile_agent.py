"""A hostile agent against the service: each attack fails with a typed error or is contained, and the
server keeps answering everyone else meanwhile.

Each test names the guarantee it holds a server to; docs/sandbox.md says how the reference server keeps it.
"""

from __future__ import annotations

import contextlib
import json

import httpx2
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


def _raw(endpoint, method: str, path: str, body: dict | None = None, headers: dict | None = None,
         **kwargs) -> httpx2.Response:
    """A request sent as the JSON the body encodes to with ASCII escapes (so a lone surrogate travels)."""
    url, token = endpoint
    content = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json", **(headers or {})}
    return httpx2.request(method, f"{url}{path}", content=content, timeout=30, headers=headers, **kwargs)


def _assert_error(response: httpx2.Response, status: int, code: str) -> None:
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


# ---- 2. non-regular files never block the server ----------------------------------------------
def test_a_fifo_in_the_workspace_never_blocks_the_server(run, endpoint):
    import asyncio

    async def body(client):
        sid = await client.create({})
        try:
            made = await client.exec(sid, "mkfifo lonely waited && ls -l")
            assert made.exit_code == 0, made.stderr
            for path in ("lonely", "waited"):
                with pytest.raises(SandboxRequestError) as refused:
                    await asyncio.wait_for(client.write_file(sid, path, "x"), timeout=10)
                assert (refused.value.status, refused.value.code) == (400, "not_a_regular_file")
                with pytest.raises(SandboxRequestError) as refused_read:
                    await asyncio.wait_for(client.read_file(sid, path), timeout=10)
                assert (refused_read.value.status, refused_read.value.code) == (400, "not_a_regular_file")
            # A FIFO with a reader on the other end: opening it for writing would succeed; still refused.
            reader = asyncio.create_task(client.exec(sid, "cat waited", timeout_s=15))
            await asyncio.sleep(1.0)
            with pytest.raises(SandboxRequestError) as with_reader:
                await asyncio.wait_for(client.write_file(sid, "waited", "x"), timeout=10)
            assert with_reader.value.code == "not_a_regular_file"
            assert (await asyncio.wait_for(client.health(), timeout=5))["status"] == "ok"
            reader.cancel()
            with contextlib.suppress(BaseException):
                await reader
            assert await client.list_files(sid) == []  # FIFOs are not files
            child = await asyncio.wait_for(client.fork(sid), timeout=20)  # the copy skips them, never opens them
            await client.delete(child)
        finally:
            await client.delete(sid)

    run(body)
    _assert_still_serving(run)


# ---- 5. typed 4xx for directories, deep trees and oversized bodies ------------------------------
def test_directories_as_files_get_400_is_a_directory(run):
    async def body(client):
        sid = await client.create({"pkg/mod.py": "x = 1\n"})
        try:
            for call in (client.read_file(sid, "pkg"), client.read_bytes(sid, "pkg"), client.write_file(sid, "pkg", "x")):
                with pytest.raises(SandboxRequestError) as caught:
                    await call
                assert (caught.value.status, caught.value.code) == (400, "is_a_directory")
        finally:
            await client.delete(sid)

    run(body)


def test_a_very_deep_directory_tree_gets_typed_errors_and_is_deleted(run, endpoint):
    deep = "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nopen('leaf.txt', 'w').write('x')\n"

    async def body(client):
        sid = await client.create({"deep.py": deep})
        deleted = False
        try:
            made = await client.exec(sid, ["python", "deep.py"], timeout_s=60)
            assert made.exit_code == 0, made.stderr
            for call in (client.list_files(sid), client.fork(sid)):
                try:
                    await call  # a server may support it; if not, a typed 4xx, never a 5xx or a reset
                except SandboxRequestError as exc:
                    assert 400 <= exc.status < 500 and exc.code, exc
            await client.delete(sid)
            deleted = True
            assert sid not in _raw(endpoint, "GET", "/v1/sandboxes").json()["sandboxes"]
        finally:
            if not deleted:
                await client.delete(sid)

    run(body, max_retries=0)
    _assert_still_serving(run)


def test_an_oversized_chunked_body_gets_413(endpoint, health):
    url, token = endpoint
    limit = health["limits"]["max_request_bytes"]

    def chunks():
        piece = b"x" * (1 << 16)
        for _ in range(limit // len(piece) + 2):
            yield piece

    response = httpx2.post(f"{url}/v1/sandboxes", content=chunks(), timeout=60,
                          headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    _assert_error(response, 413, "payload_too_large")


# ---- 3. one sandbox cannot starve the others ----------------------------------------------------
def _enforced(health: dict, limit: str) -> str:
    how = health["isolation"].get("enforced", {}).get(limit)
    if not how:
        pytest.skip(f"server reports {limit} as not enforced")
    return how


def test_a_process_flood_in_one_sandbox_never_starves_another(run, health):
    _enforced(health, "processes_per_sandbox")
    flood = health["limits"]["max_processes"] + 100
    hold = f"i=0; while [ $i -lt {flood} ]; do sleep 30 & i=$((i+1)); done 2>/dev/null; echo held; sleep 30"
    check = ["python", "-c", "import subprocess\nfor _ in range(20):\n    subprocess.run(['true'], check=True)\n"
             "print('forked fine')"]

    async def body(client):
        import asyncio

        hog, victim = await client.create({}), await client.create({})
        try:
            flooding = asyncio.create_task(client.exec(hog, hold, timeout_s=8))
            await asyncio.sleep(3.0)  # the flood is at its limit by now
            result = await client.exec(victim, check, timeout_s=30)
            assert (result.exit_code, result.stdout) == (0, "forked fine\n"), result.stderr
            with contextlib.suppress(Exception):
                await flooding
        finally:
            await client.delete(hog)
            await client.delete(victim)

    run(body)
    _assert_still_serving(run)


def test_memory_over_the_sandbox_limit_is_stopped_across_processes(run, health):
    _enforced(health, "memory_per_sandbox")
    limit = health["limits"]["memory_bytes"]
    per_process = min(limit // 2, health["limits"]["address_space_bytes"] // 2)
    count = limit // per_process + 2  # together well past the limit, each under its own rlimit
    # "done" only after holding the memory for 5 s: a process may be killed after it has touched its pages
    # (all of them printed "held" once, one then being killed), so surviving is what counts
    grab = (f"import time\nx = bytearray({per_process})\nfor i in range(0, len(x), 4096):\n    x[i] = 1\n"
            "time.sleep(5)\nprint('done')\n")

    async def body(client):
        sid = await client.create({"grab.py": grab})
        try:
            result = await client.exec(sid, " & ".join(["python grab.py"] * count) + " ; wait", timeout_s=30)
            assert result.stdout.count("done") < count, (result.stdout, result.stderr)
        finally:
            await client.delete(sid)

    run(body)
    _assert_still_serving(run)


# ---- 6. disk and /tmp are capped ----------------------------------------------------------------
def test_disk_and_tmp_writes_stop_at_their_quota(run, health):
    _enforced(health, "disk_per_sandbox")
    disk, tmp = health["limits"]["disk_bytes"], health["limits"]["tmp_bytes"]
    mib = 1 << 20
    # Files of at most the per-file limit (RLIMIT_FSIZE, below the disk quota by default), until one
    # fails: one big file stopped at that limit would leave the disk half empty.
    chunk = min(health["limits"].get("file_size_bytes", disk), disk + 8 * mib)
    fill = f"i=0; while head -c {chunk} /dev/zero > big$i; do i=$((i+1)); done; cat big* | wc -c"

    async def body(client):
        sid = await client.create({})
        try:
            full = await client.exec(sid, fill, timeout_s=120)
            written = int(full.stdout.split()[-1])
            assert disk - 2 * mib <= written <= disk, full
            with pytest.raises(SandboxRequestError) as refused:
                await client.write_file(sid, "more.txt", "x" * mib)
            assert (refused.value.status, refused.value.code) == (413, "disk_quota_exceeded")
            child = await client.fork(sid)  # a full sandbox still forks (same quota)
            await client.delete(child)
            await client.exec(sid, "rm big*")
            if health["isolation"]["enforced"].get("tmp_per_command", "").startswith("private tmpfs"):
                capped = await client.exec(sid, f"head -c {tmp + 8 * mib} /dev/zero > /tmp/big; echo rc=$?; "
                                                "wc -c < /tmp/big", timeout_s=60)
                assert "rc=0" not in capped.stdout and int(capped.stdout.split()[-1]) <= tmp, capped
            await client.write_file(sid, "after.txt", "space again")
        finally:
            await client.delete(sid)

    run(body)
    _assert_still_serving(run)


# ---- 8. no command runs as root ------------------------------------------------------------------
def test_commands_do_not_run_as_root_unless_the_server_says_so(run, health):
    says_root = any("run as root" in line for line in health["isolation"]["not_isolated"])

    async def body(client):
        sid = await client.create({})
        try:
            return (await client.exec(sid, "id -u")).stdout.strip()
        finally:
            await client.delete(sid)

    uid = run(body)
    assert uid != "0" or says_root


# ---- 4. reward for nothing ------------------------------------------------------------------------
def test_scoring_on_this_server_gives_no_reward_for_the_reported_attacks(run):
    """The three reported holes, scored through this server (fork, exec with stdin, file writes)."""
    from sandbox_client import score_submission

    buggy = "def parse_date(s):\n    y, m, d = s.split('-')\n    return int(y), int(d), int(m)\n"
    fixed = buggy.replace("int(d), int(m)", "int(m), int(d)")
    task = {"utils.py": buggy}
    hidden = {"hidden_tests/test_hidden.py": "from utils import parse_date\n\ndef test_order():\n"
              "    assert parse_date('2024-01-02') == (2024, 1, 2)\n"}
    passes = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
              "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")
    attempts = {
        "exit_on_import": {"utils.py": "import os\nos._exit(0)\n"},
        "gc_registered_hook": {"utils.py": buggy + (
            "import gc\nclass _Pass:\n    @staticmethod\n    def pytest_pyfunc_call(pyfuncitem):\n        return True\n"
            "for o in gc.get_objects():\n    if type(o).__name__ == 'Config' and hasattr(o, 'pluginmanager'):\n"
            "        o.pluginmanager.register(_Pass(), 'evil')\n")},
        "always_equal_builtin": {"utils.py": "class E(tuple):\n    __module__ = 'builtins'\n"
                                 "    def __eq__(self, other):\n        return True\n"
                                 "def parse_date(s):\n    return E()\n"},
        "callers_expected_value": {"utils.py": "import sys\ndef parse_date(s):\n    f = sys._getframe(1)\n"
                                   "    while f:\n        for c in f.f_code.co_consts:\n"
                                   "            if isinstance(c, tuple) and len(c) == 3:\n                return c\n"
                                   "        f = f.f_back\n    return None\n"},
        "ini_plugin": {"pytest.ini": "[pytest]\naddopts = -p evil\n", "evil.py": passes},
        "package_exits": {"hidden_tests/__init__.py": "import os\nos._exit(0)\n"},
        "real_fix": {"utils.py": fixed},
    }

    async def body(client):
        rewards = {}
        for name, edits in attempts.items():
            agent = await client.create(task)
            try:
                for path, content in edits.items():
                    await client.write_file(agent, path, content)
                score = await score_submission(client, task_files=task, hidden_files=hidden, agent_sandbox_id=agent,
                                               test_command="python -m pytest -q hidden_tests", timeout_s=60,
                                               required_passed=1)
                rewards[name] = score.reward
            finally:
                await client.delete(agent)
        return rewards

    assert run(body) == {"exit_on_import": 0.0, "gc_registered_hook": 0.0, "always_equal_builtin": 0.0,
                         "callers_expected_value": 0.0, "ini_plugin": 0.0, "package_exits": 0.0, "real_fix": 1.0}


def test_a_peer_command_runs_as_another_uid_that_cannot_read_the_commands_files(run, health):
    """Scoring's boundary: ``command`` (the judge) and ``peer_command`` (the agent's code) as two uids."""
    separate = health["isolation"]["enforced"].get("judge_uid_per_sandbox") is not None
    command = ["/bin/sh", "-c", "umask 077; echo secret > /tmp/judge-file; id -u; echo go >&3; cat <&4"]
    peer = ["/bin/sh", "-c", "read go; id -u; cat /tmp/judge-file 2>/dev/null || echo denied; "
            "kill -9 $PPID 2>/dev/null; echo >&1"]

    async def body(client):
        sid = await client.create({})
        try:
            return await client.exec(sid, command, peer_command=peer, timeout_s=20)
        finally:
            await client.delete(sid)

    result = run(body)
    judge_uid, peer_uid, seen = result.stdout.split()[:3]
    assert result.exit_code == 0, result
    if separate:
        assert judge_uid != peer_uid and seen == "denied", result.stdout
    else:
        assert judge_uid == peer_uid  # the server says it has no second uid (health: judge_uid_per_sandbox)


def test_arguments_and_env_too_big_to_exec_get_a_typed_4xx(endpoint, sandbox):
    exec_path = f"/v1/sandboxes/{sandbox}/exec"
    for body in ({"command": ["echo", "x" * 200_000]}, {"command": "true", "env": {"BIG": "x" * 200_000}},
                 {"command": ["echo", *(["y" * 100_000] * 25)]}):
        response = _raw(endpoint, "POST", exec_path, body)
        assert 400 <= response.status_code < 500 and response.json()["error"]["code"], response.text[:300]


def test_unknown_routes_and_methods_get_the_typed_error_shape(endpoint, sandbox):
    for method, path, status in (("GET", "/v1/no-such-route", 404), ("DELETE", "/v1/health", 405),
                                 ("PUT", f"/v1/sandboxes/{sandbox}/exec", 405)):
        response = _raw(endpoint, method, path)
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert isinstance(error["code"], str) and error["code"] and isinstance(error["message"], str), response.text


# ---- requests that are not what they seem ---------------------------------------------------------
def _raw_bytes(endpoint, path: str, content: bytes) -> httpx2.Response:
    url, token = endpoint
    return httpx2.post(f"{url}{path}", content=content, timeout=30,
                      headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})


def test_a_body_nested_past_the_json_decoder_gets_the_typed_422(endpoint, sandbox, run):
    depth = 100_000
    nested = b'{"command": ' + b"[" * depth + b"]" * depth + b"}"
    for path in (f"/v1/sandboxes/{sandbox}/exec", "/v1/sandboxes"):
        response = _raw_bytes(endpoint, path, nested)
        _assert_error(response, 422, "invalid_request")
        assert "nested" in response.json()["error"]["message"], response.text
    _assert_error(_raw_bytes(endpoint, f"/v1/sandboxes/{sandbox}/exec", b'{"command": "echo \xff"}'),
                  422, "invalid_request")  # bytes that are not UTF-8: a malformed body too
    _assert_still_serving(run)


def test_an_idempotency_key_reused_for_a_different_request_is_refused(endpoint, sandbox):
    key = "reused-key-0123"
    exec_path = f"/v1/sandboxes/{sandbox}/exec"
    first = _raw(endpoint, "POST", exec_path, {"command": "echo first >> runs.txt; echo first", "idempotency_key": key})
    assert first.status_code == 200 and first.json()["stdout"] == "first\n", first.text
    same = _raw(endpoint, "POST", exec_path, {"idempotency_key": key, "command": "echo first >> runs.txt; echo first"})
    assert same.json() == first.json()  # a true retry (keys in another order) still gets the first answer
    for other in ({"command": "echo second >> runs.txt; echo second"},
                  {"command": "echo first >> runs.txt; echo first", "timeout_s": 5}):
        response = _raw(endpoint, "POST", exec_path, {**other, "idempotency_key": key})
        _assert_error(response, 422, "idempotency_key_reused")
        assert key in response.json()["error"]["message"], response.text
    header_reuse = _raw(endpoint, "POST", exec_path, {"command": "echo third"}, headers={"Idempotency-Key": key})
    _assert_error(header_reuse, 422, "idempotency_key_reused")
    ran = _raw(endpoint, "POST", exec_path, {"command": "cat runs.txt"})
    assert ran.json()["stdout"] == "first\n", ran.text  # the refused requests never ran
    create = {"files": {"a.py": "x = 1\n"}, "idempotency_key": key}
    made = _raw(endpoint, "POST", "/v1/sandboxes", create)
    assert made.status_code == 201, made.text
    try:
        _assert_error(_raw(endpoint, "POST", "/v1/sandboxes", {**create, "files": {"a.py": "x = 2\n"}}),
                      422, "idempotency_key_reused")
    finally:
        _raw(endpoint, "DELETE", f"/v1/sandboxes/{made.json()['id']}")


@pytest.mark.parametrize(("field", "value"), [("timeout_s", True), ("timeout_s", "5"), ("ttl_s", True),
                                              ("ttl_s", "60"), ("network", 1), ("network", "false")])
def test_request_numbers_and_flags_are_not_coerced_from_other_json_types(endpoint, sandbox, field, value):
    if field == "timeout_s":
        response = _raw(endpoint, "POST", f"/v1/sandboxes/{sandbox}/exec", {"command": "true", field: value})
    else:
        response = _raw(endpoint, "POST", "/v1/sandboxes", {"files": {}, field: value})
        if response.status_code == 201:
            _raw(endpoint, "DELETE", f"/v1/sandboxes/{response.json()['id']}")
    _assert_error(response, 422, "invalid_request")
    assert field in response.json()["error"]["message"], response.text
    # an integer is a number: still accepted where a number is expected
    ok = _raw(endpoint, "POST", f"/v1/sandboxes/{sandbox}/exec", {"command": "true", "timeout_s": 5})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("binary_path", ["dup.txt", "./dup.txt"])
def test_one_path_given_twice_in_a_create_is_refused_naming_it(endpoint, binary_path):
    body = {"files": {"dup.txt": "text"}, "binary_files": {binary_path: "Ynl0ZXM="}}
    response = _raw(endpoint, "POST", "/v1/sandboxes", body)
    if response.status_code == 201:
        _raw(endpoint, "DELETE", f"/v1/sandboxes/{response.json()['id']}")
    _assert_error(response, 422, "duplicate_path")
    assert "dup.txt" in response.json()["error"]["message"], response.text
    spelled_twice = _raw(endpoint, "POST", "/v1/sandboxes", {"files": {"sub/a.txt": "1", "sub//a.txt": "2"}})
    _assert_error(spelled_twice, 422, "duplicate_path")


def test_a_file_name_that_is_not_utf8_gets_a_typed_422_and_a_fresh_score_of_zero(run):
    """An agent cannot turn its failing submission into an infrastructure error (left out of training)
    by creating a file whose name JSON cannot carry: the listing is a typed 422, and scoring on a fresh
    snapshot gives 0 with the reason."""
    from sandbox_client import score_submission

    task = {"utils.py": "def f():\n    return 1\n"}
    hidden = {"hidden_tests/test_hidden.py": "from utils import f\n\ndef test_f():\n    assert f() == 2\n"}

    async def body(client):
        agent = await client.create(task)
        try:
            made = await client.exec(agent, ["python3", "-c", "open(b'\\xff.txt', 'w').write('x')"], timeout_s=30)
            assert made.exit_code == 0, made.stderr
            with pytest.raises(SandboxRequestError) as refused:
                await client.list_files(agent)
            score = await score_submission(client, task_files=task, hidden_files=hidden, agent_sandbox_id=agent,
                                           test_command="python -m pytest -q hidden_tests", timeout_s=60,
                                           snapshot="fresh")
            return refused.value, score
        finally:
            await client.delete(agent)

    refused, score = run(body)
    assert (refused.status, refused.code) == (422, "unencodable_path")
    assert score.reward == 0.0 and "could not be listed" in score.output and "unencodable_path" in score.output
    _assert_still_serving(run)


@pytest.mark.parametrize(("path", "body"), [("/v1/sandboxes", {"files": {}, "ttl": 5}),
                                            ("exec", {"command": "true", "timeout": 5})])
def test_an_unknown_request_field_is_refused_naming_it(endpoint, sandbox, path, body):
    path = f"/v1/sandboxes/{sandbox}/exec" if path == "exec" else path
    response = _raw(endpoint, "POST", path, body)
    if response.status_code == 201:
        _raw(endpoint, "DELETE", f"/v1/sandboxes/{response.json()['id']}")
    _assert_error(response, 422, "invalid_request")
    assert ("ttl" if "ttl" in body else "timeout") in response.json()["error"]["message"], response.text


# ---- forks: linear in the workspace, never stalling the neighbours --------------------------------
_DEEP_AND_WIDE = ("import os; p = '/'.join(['d'] * 250); os.makedirs(p); "
                  "[os.mkdir(f'{p}/{i}') for i in range(10000)]")


def test_a_deep_chain_of_many_folders_forks_quickly_while_neighbours_keep_their_pace(run):
    """250 nested folders with 10,000 empty folders at the bottom (0.4 s to make): a fork whose cost
    grows with depth x folders took 31 s and stalled other sandboxes' file calls. Forks are linear in
    the entries; three at once leave a neighbour's file calls answered within a second or two."""
    import asyncio
    import time

    async def body(client):
        agent = await client.create({})
        neighbour = await client.create({"n.txt": "n"})
        children: list[str] = []
        try:
            await client.exec(agent, ["python", "-c", _DEEP_AND_WIDE], timeout_s=60)
            start = time.monotonic()
            children.append(await client.fork(agent))
            single = time.monotonic() - start
            forks = [asyncio.create_task(client.fork(agent)) for _ in range(3)]
            slowest_call = 0.0
            while not all(f.done() for f in forks):
                begin = time.monotonic()
                await client.write_file(neighbour, "n.txt", "m")
                assert await client.read_file(neighbour, "n.txt") == "m"
                slowest_call = max(slowest_call, time.monotonic() - begin)
            children += [f.result() for f in forks]
            files = await client.exec(children[-1], "find d -type d | wc -l", timeout_s=60)
            return single, slowest_call, int(files.stdout)
        finally:
            for sid in [agent, neighbour, *children]:
                await client.delete(sid)

    single, slowest_call, num_folders = run(body, timeout_s=120)
    assert num_folders == 250 + 10000  # the copy is whole
    assert single < 10, f"one fork took {single:.1f} s"
    assert slowest_call < 3, f"a neighbour's write and read took {slowest_call:.1f} s during three forks"


# ---- the kernel surface a sandboxed program never needs ------------------------------------------
# Each call with harmless arguments; without a filter most succeed for an unprivileged uid (a user
# namespace, a key in the uid's keyring shared by every sandbox of that uid, an io_uring, tracing
# oneself). Prints name=errno (0: it worked).
_FORBIDDEN_CALLS = r"""
import ctypes, os, platform
libc = ctypes.CDLL(None, use_errno=True)
numbers = {"x86_64": dict(unshare=272, add_key=248, keyctl=250, request_key=249, io_uring_setup=425, ptrace=101,
                          bpf=321, perf_event_open=298, mount=165),
           "aarch64": dict(unshare=97, add_key=217, keyctl=219, request_key=218, io_uring_setup=425, ptrace=117,
                           bpf=280, perf_event_open=241, mount=40)}[platform.machine()]
buf = ctypes.create_string_buffer(256)
args = {"unshare": (0x10000000,), "add_key": (b"user", b"k", b"v", 1, -4), "keyctl": (0, -4, 0),
        "request_key": (b"user", b"k", None, 0), "io_uring_setup": (1, buf), "ptrace": (0, 0, 0, 0),
        "bpf": (0, buf, 64), "perf_event_open": (buf, 0, -1, -1, 0), "mount": (b"none", b"/tmp", b"tmpfs", 0, None)}
for name, nr in numbers.items():
    if os.fork() == 0:  # each in a child: a success (a new namespace, being traced) must not change the next
        ok = libc.syscall(nr, *args[name]) >= 0
        print(f"{name}={0 if ok else ctypes.get_errno()}", flush=True)
        os._exit(0)
    os.wait()
"""


def test_namespaces_keyrings_io_uring_and_tracing_are_refused_to_commands(run, health):
    """No user namespace (`unshare -Ur` gives every capability inside it, `-Urm` mounts over /tmp), no
    kernel keyring (shared by every sandbox of a uid and kept after the sandbox goes), no io_uring,
    ptrace, bpf, perf events or mount."""
    import errno
    import platform

    _enforced(health, "seccomp")
    if platform.machine() not in ("x86_64", "aarch64"):
        pytest.skip("system call numbers known for x86_64 and aarch64 only")

    async def body(client):
        sid = await client.create({"calls.py": _FORBIDDEN_CALLS})
        try:
            calls = await client.exec(sid, "python calls.py")
            userns = await client.exec(sid, "unshare -Urm sh -c 'mount -t tmpfs none /tmp && echo mounted'")
            return calls, userns
        finally:
            await client.delete(sid)

    calls, userns = run(body)
    results = dict(line.split("=") for line in calls.stdout.split())
    assert len(results) == 9, calls
    assert all(int(code) in (errno.EPERM, errno.ENOSYS) for code in results.values()), results
    assert userns.exit_code != 0 and "mounted" not in userns.stdout, userns


# Leaves a SysV message queue, a POSIX message queue and an abstract Unix socket, then waits: the
# kernel objects a uid or a host could share outside the filesystem.
_LEAVE_CHANNELS = r"""
import ctypes, os, socket, time
libc, librt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL("librt.so.1", use_errno=True)
libc.msgget(0x5A17, 0o1666)
librt.mq_open(b"/agentrl-channel", os.O_CREAT | os.O_RDWR, 0o666, None)
listener = socket.socket(socket.AF_UNIX)
listener.bind("\0agentrl-channel")
listener.listen()
print("left", flush=True)
time.sleep(float(os.environ.get("HOLD_S", "0")))
"""
_FIND_CHANNELS = r"""
import ctypes, os, socket
libc, librt = ctypes.CDLL(None, use_errno=True), ctypes.CDLL("librt.so.1", use_errno=True)
found = []
if libc.msgget(0x5A17, 0) >= 0:
    found.append("sysv")
if librt.mq_open(b"/agentrl-channel", os.O_RDWR, 0, None) >= 0:
    found.append("mqueue")
try:
    socket.socket(socket.AF_UNIX).connect("\0agentrl-channel")
    found.append("abstract")
except OSError:
    pass
print(found)
"""


def test_ipc_objects_and_abstract_sockets_reach_no_other_sandbox_and_no_later_command(run, health):
    """SysV IPC and POSIX message queues live in the IPC namespace, abstract sockets in the network
    namespace: one sandbox's never reach another sandbox, nor a later command of its own."""
    import asyncio

    if not {"ipc", "network (unless network=true)"} <= set(health["isolation"].get("namespaces", [])):
        pytest.skip("server reports no IPC and network namespaces")

    async def body(client):
        leaver = await client.create({"leave.py": _LEAVE_CHANNELS, "find.py": _FIND_CHANNELS})
        other = await client.create({"find.py": _FIND_CHANNELS})
        try:
            holding = asyncio.create_task(client.exec(leaver, "python leave.py", env={"HOLD_S": "4"}, timeout_s=30))
            await asyncio.sleep(2)  # the objects exist now
            elsewhere = await client.exec(other, "python find.py")
            left = await holding
            later = await client.exec(leaver, "python find.py")
            same_command = await client.exec(leaver, "HOLD_S=3 python leave.py & sleep 1; python find.py", timeout_s=30)
            return left, elsewhere, later, same_command
        finally:
            for sid in (leaver, other):
                await client.delete(sid)

    left, elsewhere, later, same_command = run(body)
    assert left.stdout == "left\n", left
    assert same_command.stdout == "left\n['sysv', 'mqueue', 'abstract']\n", same_command  # the probe sees them
    assert elsewhere.stdout == "[]\n", elsewhere
    assert later.stdout == "[]\n", later
