"""Hostile or broken input: each gets a clear error or is contained, and the server keeps serving."""

from __future__ import annotations

from urllib.parse import urlparse

import httpx2
import pytest

from sandbox_client import CommandTimeout, SandboxRequestError


def _assert_still_serving(run):
    async def body(client):
        sid = await client.create({"ok.py": "print('alive')"})
        try:
            assert (await client.exec(sid, "python ok.py")).stdout == "alive\n"
        finally:
            await client.delete(sid)

    run(body)


def test_path_traversal_absolute_and_nul_paths_are_refused(run):
    async def body(client):
        sid = await client.create({"a.txt": "a"})
        try:
            for bad in ("../outside.txt", "/etc/passwd", "sub/../../x", "a\0b", ""):
                with pytest.raises(SandboxRequestError) as read_err:
                    await client.read_file(sid, bad)
                assert read_err.value.status in (400, 422)
                with pytest.raises(SandboxRequestError):
                    await client.write_file(sid, bad, "pwned")
            with pytest.raises(SandboxRequestError) as missing:
                await client.read_file(sid, "nope.txt")
            assert missing.value.status == 404 and missing.value.code == "file_not_found"
        finally:
            await client.delete(sid)
        with pytest.raises(SandboxRequestError):
            await client.create({"../escape.py": "x"})

    run(body)


def test_symlinks_pointing_out_of_the_workspace_are_refused(run):
    async def body(client):
        sid = await client.create({"a.txt": "inside"})
        try:
            made = await client.exec(sid, "ln -s /etc/hostname leak && ln -s / rootdir && ln -s a.txt alias")
            assert made.exit_code == 0, made.stderr
            assert await client.read_file(sid, "alias") == "inside"  # a link that stays inside is fine
            for bad in ("leak", "rootdir/etc/hostname"):
                with pytest.raises(SandboxRequestError) as caught:
                    await client.read_file(sid, bad)
                assert caught.value.code == "path_escape"
            for bad in ("leak", "rootdir/tmp/pwned.txt"):
                with pytest.raises(SandboxRequestError):
                    await client.write_file(sid, bad, "pwned")
            assert "leak" not in await client.list_files(sid)  # links are not listed as files
            child = await client.fork(sid)  # copying a workspace with links must not follow them
            with pytest.raises(SandboxRequestError):
                await client.read_file(child, "leak")
            await client.delete(child)
        finally:
            await client.delete(sid)

    run(body)


def test_nul_bytes_in_commands_and_env_are_refused(run):
    async def body(client):
        sid = await client.create({})
        try:
            with pytest.raises(SandboxRequestError):
                await client.exec(sid, ["echo", "a\0b"])
            with pytest.raises(SandboxRequestError):
                await client.exec(sid, "echo hi", env={"X": "a\0b"})
            with pytest.raises(SandboxRequestError):
                await client.exec(sid, "echo hi", env={"BAD NAME": "x"})
            echoed = await client.exec(sid, "cat", stdin="a\0b")  # NUL in stdin is just data
            assert echoed.stdout == "a\0b"
        finally:
            await client.delete(sid)

    run(body)


def test_oversized_payloads_get_413(run, health):
    max_file = health["limits"]["max_file_bytes"]
    max_request = health["limits"]["max_request_bytes"]

    async def body(client):
        sid = await client.create({})
        try:
            with pytest.raises(SandboxRequestError) as too_big:
                await client.write_file(sid, "big.txt", "x" * (max_file + 1))
            assert too_big.value.status == 413
            made = await client.exec(sid, f"head -c {max_file + 10} /dev/zero > big.bin")
            assert made.exit_code == 0
            with pytest.raises(SandboxRequestError) as too_big_read:
                await client.read_bytes(sid, "big.bin")
            assert too_big_read.value.status == 413
        finally:
            await client.delete(sid)
        with pytest.raises(SandboxRequestError) as too_big_request:
            await client.create({"huge.txt": "y" * (max_request + 1)})
        assert too_big_request.value.status == 413

    run(body)


def test_binary_and_invalid_utf8_output_is_returned_as_text(run):
    async def body(client):
        sid = await client.create({})
        try:
            result = await client.exec(sid, r"printf 'ok\377\376\000end'; head -c 300 /dev/urandom >&2")
            assert result.exit_code == 0
            assert result.stdout.startswith("ok") and result.stdout.endswith("\0end") and "\ufffd" in result.stdout
        finally:
            await client.delete(sid)

    run(body)


def test_output_is_truncated_at_the_cap_and_flagged(run, health):
    cap = health["limits"]["output_limit_bytes"]

    async def body(client):
        sid = await client.create({})
        try:
            big = await client.exec(sid, f"python -c \"print('x' * {cap * 3})\"")
            assert big.exit_code == 0 and big.truncated and len(big.stdout) <= cap
            small = await client.exec(sid, "echo small")
            assert not small.truncated
            with pytest.raises(CommandTimeout) as endless:  # infinite output ends at the timeout
                await client.exec(sid, "yes", timeout_s=1.0)
            assert endless.value.result.truncated and len(endless.value.result.stdout) <= cap
        finally:
            await client.delete(sid)

    run(body)


def test_memory_hog_is_contained(run, health):
    limit = health["limits"].get("address_space_bytes")
    if not limit:
        pytest.skip("server publishes no address-space limit")

    async def body(client):
        sid = await client.create({})
        try:
            hog = await client.exec(sid, ["python", "-c", f"x = bytearray({limit * 2}); print('allocated')"],
                                    timeout_s=20)
            assert hog.exit_code != 0 and "allocated" not in hog.stdout
            assert "MemoryError" in hog.stderr
        finally:
            await client.delete(sid)

    run(body)
    _assert_still_serving(run)


def test_fork_bomb_is_contained(run, health):
    if not health["isolation"]["process_limit_enforced"]:
        pytest.skip("server reports no process limit (commands run as root without a pid namespace)")

    async def body(client):
        sid = await client.create({})
        try:
            try:
                bomb = await client.exec(sid, "bomb() { bomb | bomb & }; bomb", timeout_s=3)
                assert bomb.duration_s < 10
            except CommandTimeout as exc:
                assert exc.result.duration_s < 10
        finally:
            await client.delete(sid)

    run(body, timeout_s=60)
    _assert_still_serving(run)


def test_network_egress_is_blocked_by_default(run, health, endpoint):
    """Only loopback is ever targeted: the sandbox tries to reach the sandbox server's own port."""
    target = urlparse(endpoint[0])
    if target.hostname != "127.0.0.1":
        pytest.skip("egress check only runs against a server on 127.0.0.1")
    if not health["isolation"]["network_isolated_by_default"]:
        pytest.skip("server reports no network isolation")
    probe = ["python", "-c", f"import socket; socket.create_connection(('127.0.0.1', {target.port}), timeout=2);"
             " print('connected')"]

    async def body(client):
        isolated = await client.create({})
        shared = await client.create({}, network=True)
        try:
            blocked = await client.exec(isolated, probe, timeout_s=10)
            assert blocked.exit_code != 0 and "connected" not in blocked.stdout
            allowed = await client.exec(shared, probe, timeout_s=10)  # the probe itself can succeed
            assert allowed.exit_code == 0 and allowed.stdout == "connected\n"
        finally:
            await client.delete(isolated)
            await client.delete(shared)

    run(body)


def test_malformed_requests_get_a_structured_error(endpoint):
    url, token = endpoint
    headers = {"Authorization": f"Bearer {token}"}
    response = httpx2.post(f"{url}/v1/sandboxes", headers=headers, content=b"{not json", timeout=30)
    assert response.status_code in (400, 422)
    assert set(response.json()["error"]) >= {"code", "message"}
