"""Containment guarantees of the reference server that a protocol client cannot observe: what the host
side of a command sees, the workspace root's lifetime, and the refusal to run commands as root."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from sandbox_client import SandboxClient, SandboxRequestError
from sandbox_server.isolation import HOST_ENV
from sandbox_server.launch import start_local_server
from sandbox_server.limits import claim_uids, mounts_under
from sandbox_server.options import UID_MAX, ServerOptions

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="needs a server running as root")


def _children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_the_host_side_of_a_command_never_sees_the_request_env():
    with start_local_server() as server:
        if server.health()["isolation"]["backend"] != "bwrap":
            pytest.skip("the process backend starts the command itself with the request env")

        async def main():
            async with SandboxClient(server.url, server.token) as client:
                sid = await client.create({})
                running = asyncio.create_task(client.exec(sid, "sleep 3", env={"MARK_FROM_REQUEST": "1"}))
                helpers: list[int] = []
                for _ in range(40):
                    await asyncio.sleep(0.1)
                    helpers = _children(server.process.pid)
                    if helpers:
                        break
                environments = [_environ(pid) for pid in helpers]
                await running
                await client.delete(sid)
                return environments

        environments = asyncio.run(main())
        assert environments, "no helper process seen"
        for environment in environments:
            assert environment == HOST_ENV


@ROOT_ONLY
def test_commands_never_run_as_root_without_the_explicit_flag():
    with pytest.raises(RuntimeError, match="allow-root-commands"):
        start_local_server(isolation="process", sandbox_uid=-1)
    with start_local_server(isolation="process", sandbox_uid=-1, allow_root_commands=True) as server:
        health = server.health()
        assert any("commands run as root" in line for line in health["isolation"]["not_isolated"])


@ROOT_ONLY
def test_each_live_sandbox_runs_as_its_own_uid():
    with start_local_server() as server:
        if not server.health()["isolation"]["enforced"]["uid_per_sandbox"]:
            pytest.skip("server reports no per-sandbox uid")

        async def main():
            async with SandboxClient(server.url, server.token) as client:
                ids = [await client.create({}) for _ in range(3)]
                uids = [(await client.exec(sid, "id -u")).stdout.strip() for sid in ids]
                for sid in ids:
                    await client.delete(sid)
                return uids

        uids = asyncio.run(main())
        assert len(set(uids)) == 3 and "0" not in uids


@ROOT_ONLY
def test_a_killed_servers_leftovers_are_removed_by_the_next_start(tmp_path):
    root = tmp_path / "boxes"
    with start_local_server(root_dir=str(root)) as killed:

        async def fill():
            async with SandboxClient(killed.url, killed.token) as client:
                sid = await client.create({"a.txt": "left behind"})
                await client.exec(sid, "head -c 100000 /dev/zero > blob")
                return sid

        sid = asyncio.run(fill())
        quota = killed.health()["isolation"]["enforced"]["disk_per_sandbox"]
        killed.process.kill()
        killed.process.wait()
    assert (root / sid / "workspace" / "a.txt").exists()
    if quota:
        assert root / sid in mounts_under(root)
    with start_local_server(root_dir=str(root)):
        assert [p.name for p in root.iterdir()] == [".lock"]
        assert mounts_under(root) == []


def _uid_range(server) -> tuple[int, int]:
    """The first and last uid of the server's sandboxes and judges, from /v1/health."""
    enforced = server.health()["isolation"]["enforced"]
    if not enforced["uid_per_sandbox"] or not enforced["judge_uid_per_sandbox"]:
        pytest.skip("server reports no per-sandbox uid")
    first = int(enforced["uid_per_sandbox"].split()[1].split("..")[0])
    last = int(enforced["judge_uid_per_sandbox"].split()[1].split("..")[1])
    return first, last


def test_claimed_uid_ranges_never_overlap_and_are_free_again_once_released(tmp_path):
    lock = tmp_path / "uids.lock"
    first, first_fd = claim_uids(1000, 16, lock)
    second, second_fd = claim_uids(1000, 200, lock)  # 1000..1199 overlaps 1000..1015
    assert first == 1000 and second == 1200
    third, third_fd = claim_uids(1250, 8, lock)  # inside the second's 1200..1399
    assert third == 1402  # 1250 + 8k: the first such range above 1399
    os.close(first_fd)
    again, again_fd = claim_uids(1000, 16, lock)
    assert again == 1000
    for fd in (second_fd, third_fd, again_fd):
        os.close(fd)
    held, held_fd = claim_uids(UID_MAX - 15, 16, lock)
    with pytest.raises(RuntimeError, match="no 16 free uids"):  # never past 2**31 - 1 (2**32 - 1 is "no change")
        claim_uids(UID_MAX - 15, 16, lock)
    os.close(held_fd)
    with pytest.raises(ValueError, match="exceeds the highest sandbox uid"):
        ServerOptions(token="t", sandbox_uid=UID_MAX - 8, max_sandboxes=8)


def test_the_uid_lock_lives_in_the_first_folder_no_one_else_can_write(tmp_path, monkeypatch):
    import sandbox_server.limits as limits

    open_to_all, own = tmp_path / "open", tmp_path / "own"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o1777)  # like /tmp or /run/lock: anyone could plant or hold the lock file
    own.mkdir(mode=0o755)
    (tmp_path / "link").symlink_to(own)  # a symlink is not trusted either
    monkeypatch.setattr(limits, "UID_LOCK_FOLDERS", (tmp_path / "missing", open_to_all, tmp_path / "link", own))
    assert limits.uid_lock_file() == own / limits.UID_LOCK_NAME
    monkeypatch.setattr(limits, "UID_LOCK_FOLDERS", (open_to_all,))
    with pytest.raises(RuntimeError, match="nowhere to lock the sandbox uids"):
        limits.uid_lock_file()


@ROOT_ONLY
def test_two_live_servers_on_one_host_never_share_a_uid():
    """A second server whose uids would overlap the first's (its sandbox uids would be the first's judge
    uids, and a fork bomb in one would exhaust the other's per-uid process limit) takes the next free
    range; a third, after the first stopped, may reuse the first's."""
    with start_local_server(max_sandboxes=8, sandbox_uid=300000) as first:
        first_range = _uid_range(first)
        assert first_range == (300000, 300015)
        with start_local_server(max_sandboxes=16, sandbox_uid=300000) as second:
            second_range = _uid_range(second)
            assert second_range[0] > first_range[1]  # disjoint, above

            async def uid() -> int:
                async with SandboxClient(second.url, second.token) as client:
                    sid = await client.create({})
                    return int((await client.exec(sid, "id -u")).stdout)

            assert asyncio.run(uid()) == second_range[0]  # its first sandbox runs at its own range
    with start_local_server(max_sandboxes=8, sandbox_uid=300000) as third:
        assert _uid_range(third) == first_range


def test_a_root_held_by_a_live_server_is_not_taken_or_cleaned(tmp_path):
    root = tmp_path / "boxes"
    with start_local_server(root_dir=str(root)) as first:

        async def make():
            async with SandboxClient(first.url, first.token) as client:
                return await client.create({"a.txt": "mine"})

        sid = asyncio.run(make())
        started = time.monotonic()
        with pytest.raises(RuntimeError, match="in use by another running sandbox server"):
            start_local_server(root_dir=str(root))
        assert time.monotonic() - started < 30
        assert (root / sid / "workspace" / "a.txt").read_text() == "mine"


def test_every_command_starts_with_the_servers_rlimits():
    with start_local_server(max_processes=77, address_space_bytes=3 << 30, open_files=99) as server:

        async def main():
            async with SandboxClient(server.url, server.token) as client:
                sid = await client.create({})
                limits = (await client.exec(sid, "cat /proc/self/limits")).stdout
                await client.delete(sid)
                return limits

        rows = {line[:26].strip(): line[26:].split()[:2] for line in asyncio.run(main()).splitlines()[1:]}
        assert rows["Max processes"] == ["77", "77"]
        assert rows["Max address space"] == [str(3 << 30)] * 2
        assert rows["Max open files"] == ["99", "99"]
        assert rows["Max core file size"] == ["0", "0"]


def test_a_sandbox_with_a_1500_level_tree_is_refused_for_listing_and_fork_and_deleted_from_disk(tmp_path):
    root = tmp_path / "boxes"
    deep = "import os\nfor _ in range(1500):\n    os.mkdir('d')\n    os.chdir('d')\nopen('leaf', 'w').write('x')\n"
    with start_local_server(root_dir=str(root)) as server:

        async def main():
            async with SandboxClient(server.url, server.token, max_retries=0) as client:
                sid = await client.create({"deep.py": deep})
                assert (await client.exec(sid, ["python", "deep.py"], timeout_s=60)).exit_code == 0
                codes = []
                for call in (client.list_files(sid), client.fork(sid)):
                    try:
                        await call
                    except SandboxRequestError as exc:
                        codes.append((exc.status, exc.code))
                await client.delete(sid)
                return codes, (await client.health())["sandboxes"]["active"]

        codes, active = asyncio.run(main())
        assert codes == [(400, "tree_too_deep"), (400, "tree_too_deep")]
        assert active == 0
        assert [p.name for p in root.iterdir() if not p.name.startswith(".")] == []


def test_sandboxes_together_cannot_use_more_than_the_total_memory_limit():
    """Each sandbox is under its own limit (128 MiB), yet two of them at 80 MiB each exceed the 120 MiB
    that all sandboxes share: the kernel kills inside a sandbox, and the server keeps serving."""
    hog = ("import time\nblock = bytearray(80 << 20)\nfor i in range(0, len(block), 4096):\n    block[i] = 1\n"
           "time.sleep(3)\nprint('survived')\n")
    with start_local_server(memory_bytes=128 << 20, total_memory_bytes=120 << 20) as server:
        async def main():
            async with SandboxClient(server.url, server.token) as client:
                health = await client.health()
                boxes = [await client.create({"hog.py": hog}) for _ in range(2)]
                results = await asyncio.gather(*(client.exec(b, ["python", "hog.py"], timeout_s=30) for b in boxes))
                alone = await client.exec(boxes[0], ["python", "hog.py"], timeout_s=30)
                for box in boxes:
                    await client.delete(box)
                return health, results, alone

        health, results, alone = asyncio.run(main())
    if health["isolation"]["enforced"]["memory_all_sandboxes"] is None:
        pytest.skip("no writable cgroups on this host: the server reports memory_all_sandboxes as not enforced")
    assert alone.stdout.strip() == "survived", alone  # one sandbox alone fits both limits
    assert sum(r.stdout.strip() == "survived" for r in results) <= 1, results


def test_bwrap_commands_run_under_the_seccomp_filter():
    """The reference server under bubblewrap always applies its filter (libseccomp is an install step):
    the conformance test of the refused calls then runs instead of skipping. docs/sandbox.md lists
    every refused call."""
    from sandbox_server.seccomp import REFUSED_SYSCALLS

    docs = (Path(__file__).resolve().parents[2] / "docs" / "sandbox.md").read_text()
    assert [name for name in REFUSED_SYSCALLS if f"`{name}`" not in docs] == []
    with start_local_server(isolation="auto") as server:
        isolation = server.health()["isolation"]
    if isolation["backend"] != "bwrap":
        pytest.skip("no bubblewrap on this host")
    assert "seccomp filter refusing" in isolation["enforced"]["seccomp"], isolation


_FORK_AND_HOLD = ("import os, time\nheld = 0\nfor _ in range(30):\n    try:\n        if os.fork() == 0:\n"
                  "            time.sleep(4)\n            os._exit(0)\n        held += 1\n    except OSError:\n"
                  "        break\nprint(held, flush=True)\ntime.sleep(4)\n")


def test_sandboxes_together_cannot_hold_more_processes_than_the_total_limit():
    """Each sandbox may hold 30 processes, all of them together 40: two sandboxes forking at once get
    40 between them, not 60. A total at or above kernel.pid_max is refused at start, naming it."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    with pytest.raises(RuntimeError, match=rf"total_processes \({pid_max}\) must be below this host's kernel.pid_max"):
        start_local_server(total_processes=pid_max)
    with start_local_server(max_processes=30, total_processes=40) as server:
        async def main():
            async with SandboxClient(server.url, server.token) as client:
                health = await client.health()
                boxes = [await client.create({"hold.py": _FORK_AND_HOLD}) for _ in range(2)]
                results = await asyncio.gather(*(client.exec(b, ["python", "hold.py"], timeout_s=30) for b in boxes))
                for box in boxes:
                    await client.delete(box)
                return health, [int(r.stdout.split()[0]) for r in results]

        health, held = asyncio.run(main())
    if health["isolation"]["enforced"]["processes_all_sandboxes"] is None:
        pytest.skip("no writable cgroups on this host: the server reports processes_all_sandboxes as not enforced")
    assert health["limits"]["total_processes"] == 40
    assert 20 <= sum(held) <= 40 - 2, held  # each exec's own python counts too


def test_pages_the_server_writes_for_a_sandbox_are_charged_to_that_sandbox(tmp_path):
    """The pages of a fork's copy and of write_file (tmpfs: memory) count against the sandbox's own
    memory limit and the limit of all sandboxes together, not against the server: each fork of a
    250 MiB workspace added 252 MiB to the server's own group."""
    import hashlib

    root = tmp_path / "boxes"
    with start_local_server(root_dir=str(root)) as server:
        async def main():
            async with SandboxClient(server.url, server.token) as client:
                health = await client.health()
                group = Path("/sys/fs/cgroup/memory") / f"agentrl-{hashlib.sha256(str(root.resolve()).encode()).hexdigest()[:12]}"
                agent = await client.create({})
                await client.write_file(agent, "written.bin", os.urandom(8_000_000))
                written = int((group / agent / "memory.usage_in_bytes").read_text()) if group.exists() else None
                await client.exec(agent, "head -c 24000000 /dev/urandom > blob")
                child = await client.fork(agent)
                copied = int((group / child / "memory.usage_in_bytes").read_text()) if group.exists() else None
                for sid in (agent, child):
                    await client.delete(sid)
                return health, written, copied

        health, written, copied = asyncio.run(main())
    if health["isolation"]["enforced"]["memory_per_sandbox"] is None or written is None:
        pytest.skip("no cgroup v1 memory hierarchy written by this server")
    assert written >= 8_000_000, written
    assert copied >= 32_000_000, copied


def test_vsock_and_af_key_sockets_are_refused_to_commands():
    """AF_VSOCK is not per network namespace (on a VM host it reaches the hypervisor): the filter refuses the
    family with EPERM (without it the kernel answers the call, or says the family is unsupported)."""
    probe = ("import errno, socket\nfor family in (40, 15):\n    try:\n        socket.socket(family, socket.SOCK_STREAM"
             " if family == 40 else socket.SOCK_RAW).close()\n        print(family, 'open')\n    except OSError as exc:\n"
             "        print(family, errno.errorcode.get(exc.errno))\n")
    with start_local_server(isolation="auto") as server:
        async def main():
            async with SandboxClient(server.url, server.token) as client:
                health = await client.health()
                box = await client.create({"probe.py": probe})
                result = await client.exec(box, ["python", "probe.py"], timeout_s=30)
                await client.delete(box)
                return health, result

        health, result = asyncio.run(main())
    if not (health["isolation"]["enforced"] or {}).get("seccomp"):
        pytest.skip("no seccomp filter on this host (process backend or no libseccomp)")
    assert result.stdout.split() == ["40", "EPERM", "15", "EPERM"], result
