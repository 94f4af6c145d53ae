"""Hidden-test scoring in a fresh sandbox: the agent's edits count, its own tests and conftest do not."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandbox_client import SandboxClient, score_submission
from sandbox_client.scoring import is_agent_test_file

TASK = {
    "utils.py": "def parse_date(s):\n    y, m, d = s.split('-')\n    return int(y), int(d), int(m)\n",
    "test_visible.py": "from utils import parse_date\n\ndef test_year():\n    assert parse_date('2024-01-02')[0] == 2024\n",
}
HIDDEN = {"hidden_tests/test_hidden.py": "from utils import parse_date\n\ndef test_order():\n    assert parse_date('2024-01-02') == (2024, 1, 2)\n"}
FIXED = "from helpers import to_int\n\ndef parse_date(s):\n    y, m, d = s.split('-')\n    return to_int(y), to_int(m), to_int(d)\n"
# An agent trying to game the hidden run: a conftest that turns every failure into a pass.
CHEAT = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\ndef pytest_runtest_makereport(item, call):\n"
         "    outcome = yield\n    outcome.get_result().outcome = 'passed'\n")


def _score(server, edits: dict[str, str], **kwargs):
    async def main():
        async with SandboxClient(server.url, server.token) as client:
            agent = await client.create(TASK)
            for path, content in edits.items():
                await client.write_file(agent, path, content)
            before = set((await client.health())["sandboxes"].items())
            result = await score_submission(client, task_files=TASK, hidden_files=HIDDEN, agent_sandbox_id=agent,
                                            test_command=kwargs.pop("test_command", "python -m pytest -q hidden_tests"),
                                            timeout_s=kwargs.pop("timeout_s", 60), **kwargs)
            after = set((await client.health())["sandboxes"].items())
            agent_files = await client.list_files(agent)
            await client.delete(agent)
            return result, before == after, agent_files

    return asyncio.run(main())


@pytest.mark.parametrize("snapshot", ["fork", "fresh"])
def test_correct_fix_scores_one_and_carries_only_source_files(sandbox_server, snapshot):
    result, no_leak, agent_files = _score(sandbox_server, {"utils.py": FIXED, "helpers.py": "def to_int(x):\n    return int(x)\n",
                                                   "test_visible.py": "def test_nothing():\n    pass\n"},
                                          snapshot=snapshot, required_passed=1)
    assert (result.reward, result.passed, result.timed_out) == (1.0, True, False), result.output
    assert (result.snapshot, result.num_passed, result.num_failed) == (snapshot, 1, 0)
    assert result.carried_files == (["helpers.py", "utils.py"] if snapshot == "fresh" else [])
    assert not any("test_hidden" in path for path in agent_files)  # hidden tests never entered the agent's sandbox
    assert no_leak  # the scoring sandbox was deleted


def test_unfixed_code_and_a_cheating_conftest_score_zero(sandbox_server):
    result, no_leak, _ = _score(sandbox_server, {"conftest.py": CHEAT, "tests/conftest.py": CHEAT})
    assert (result.reward, result.passed) == (0.0, False)
    assert result.carried_files == [] and "1 failed" in result.output
    assert no_leak


def test_scoring_timeout_gives_the_timeout_reward(sandbox_server):
    # helpers.py too: without it the import fails at once and the run ends before its timeout
    slow = {"utils.py": FIXED + "import time\ntime.sleep(30)\n", "helpers.py": "def to_int(x):\n    return int(x)\n"}
    result, no_leak, _ = _score(sandbox_server, slow, timeout_s=1.0, timeout_reward=-0.5)
    outcome = (result.reward, result.passed, result.timed_out)
    assert outcome == (-0.5, False, True), f"carried {result.carried_files}; output:\n{result.output}"
    assert no_leak


@pytest.mark.parametrize("path,expected", [
    ("test_a.py", True), ("pkg/a_test.py", True), ("conftest.py", True), ("tests/data.json", True),
    ("pkg/tests/helpers.py", True), ("utils.py", False), ("testing.py", False), ("contest.py", False),
])
def test_agent_test_files_are_recognised(path, expected):
    assert is_agent_test_file(path) is expected


def test_a_service_without_peer_command_is_an_infrastructure_error_not_a_zero(sandbox_server):
    """The judge refuses to score without its pipes to the agent's process (a server that ignores
    ``peer_command``): the scorer raises SandboxInfraError, so no episode gets a reward of 0 for it."""
    from sandbox_client.errors import SandboxInfraError
    from sandbox_client.scoring import JUDGE_ARGV, HiddenCommand, _judge

    command = HiddenCommand.parse("python -m pytest -q hidden_tests", HIDDEN)

    async def main():
        async with SandboxClient(sandbox_server.url, sandbox_server.token) as client:
            sid = await client.create(TASK)
            try:
                return await client.exec(sid, JUDGE_ARGV, stdin=command.payload(HIDDEN, "n0nce", 20), timeout_s=30)
            finally:
                await client.delete(sid)

    result = asyncio.run(main())
    with pytest.raises(SandboxInfraError, match="peer_command"):
        _judge(result.stdout, result.stderr, "n0nce", 1, 0.0, [], "fork")


def test_an_exception_reaches_the_hidden_tests_with_its_own_arguments(sandbox_server):
    """Correct code must not score 0 because an exception crossed the process boundary as its message:
    ``KeyError('x').args`` is ``('x',)``, its ``str`` is ``"'x'"``."""
    hidden = ("import pytest\nfrom lookup import get\n\ndef test_missing():\n"
              "    with pytest.raises(KeyError) as caught:\n        get({}, 'x')\n"
              "    assert caught.value.args == ('x',)\n\n"
              "def test_io():\n    with pytest.raises(OSError) as caught:\n        get(None, 'x')\n"
              "    assert caught.value.args == (2, 'gone')\n")
    correct = "def get(d, k):\n    if d is None:\n        raise OSError(2, 'gone')\n    return d[k]\n"

    async def main():
        async with SandboxClient(sandbox_server.url, sandbox_server.token) as client:
            agent = await client.create({"lookup.py": correct})
            try:
                return await score_submission(client, task_files={"lookup.py": correct},
                                              hidden_files={"hidden_tests/test_hidden.py": hidden},
                                              agent_sandbox_id=agent, test_command="python -m pytest -q hidden_tests",
                                              timeout_s=60, required_passed=2)
            finally:
                await client.delete(agent)

    result = asyncio.run(main())
    assert (result.reward, result.num_passed, result.num_failed) == (1.0, 2, 0), result.output


_WIRE_CHECK = r"""
import datetime, decimal, fractions, json
import sandbox_client.score_peer as peer, sandbox_client.score_runner as judge
values = [None, True, 3, 2.5, "s", (1, "a"), frozenset({1, 2}), b"\x00\xff", decimal.Decimal("1.10"),
          fractions.Fraction(1, 3), 1 + 2j, range(1, 9, 2), datetime.date(2024, 1, 2),
          datetime.datetime(2024, 1, 2, 3, 4, 5), datetime.time(3, 4), datetime.timedelta(1, 2, 3)]
wire = lambda v: json.loads(json.dumps(v))
for value in values:
    for sender, receiver in ((peer, judge), (judge, peer)):
        back = receiver.decode(wire(sender.encode(value)))
        assert back == value and type(back) is type(value), (sender.__name__, value, back)
print("same wire format")
"""


def test_the_judge_and_the_peer_read_each_others_standard_values():
    """score_runner and score_peer are separate single-file programs on either side of the trust
    boundary (each runs as ``python -I -B -c SOURCE``, standard library only), so each writes its own
    copy of the wire format for standard values; this keeps the two copies from drifting apart."""
    done = subprocess.run([sys.executable, "-c", _WIRE_CHECK], capture_output=True, text=True, timeout=60,
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0 and "same wire format" in done.stdout, done.stderr[-2000:]


def test_the_judges_folder_is_private_and_its_removal_never_follows_a_link(tmp_path):
    """The judge makes its hidden-files folder and removes it without ``tempfile``/``shutil`` (their
    imports cost more than a copy-the-key check's own work): a new 0700 folder each time, and a
    removal that unlinks links (to a folder or a file) rather than emptying what they point at."""
    import os
    import stat

    from sandbox_client import score_runner as judge

    outside = tmp_path / "outside"
    (outside / "inner").mkdir(parents=True)
    (outside / "keep.txt").write_text("kept")
    (outside / "inner" / "deep.txt").write_text("kept")
    root, other = judge._private_folder(), judge._private_folder()
    assert root != other and all(stat.S_IMODE(os.stat(p).st_mode) == 0o700 for p in (root, other))
    os.makedirs(os.path.join(root, "tests", "sub"))
    Path(root, "tests", "sub", "a.py").write_text("x")
    os.symlink(outside, os.path.join(root, "tests", "to_dir"))
    os.symlink(outside / "keep.txt", os.path.join(root, "to_file"))
    for folder in (root, other):
        judge._remove_tree(folder)
        assert not os.path.lexists(folder)
    assert (outside / "keep.txt").read_text() == "kept" and (outside / "inner" / "deep.txt").exists()


def test_the_agents_code_and_the_hidden_tests_import_installed_packages(sandbox_server):
    """The peer (the agent's modules) and the judge (pytest, the hidden tests) find installed packages."""
    uses_installed = "import packaging.version\n\n" + FIXED.replace("to_int(d)", "to_int(str(packaging.version.Version(d)))")
    result, _, _ = _score(sandbox_server, {"utils.py": uses_installed, "helpers.py": "def to_int(x):\n    return int(x)\n"},
                          required_passed=1)
    assert (result.reward, result.passed) == (1.0, True), result.output


def _exec_pair(server, command: list[str], peer: list[str], timeout_s: float = 30, lazy_peer: bool = True):
    """(exec result, seconds, workspace files after) of one exec with a peer, in a fresh sandbox."""
    async def main():
        async with SandboxClient(server.url, server.token) as client:
            sid = await client.create({})
            try:
                started = time.monotonic()
                result = await client.exec(sid, command, peer_command=peer, timeout_s=timeout_s, lazy_peer=lazy_peer)
                return result, time.monotonic() - started, await client.list_files(sid)
            finally:
                await client.delete(sid)

    return asyncio.run(main())


def test_a_lazy_peer_starts_only_when_the_command_first_writes_to_it(sandbox_server):
    """With ``lazy_peer`` (scoring's setting) a hidden check that never calls the agent's code (one
    reading answer.txt) costs no peer process; one that does gets the peer, with its first request
    already waiting in the pipe."""
    peer = ["/bin/sh", "-c", "touch peer-ran; read request; echo \"got $request\""]
    silent, _, files = _exec_pair(sandbox_server, ["/bin/sh", "-c", "sleep 0.5; echo done"], peer)
    assert (silent.exit_code, silent.stdout.strip()) == (0, "done")
    assert "peer-ran" not in files  # started with the command, the peer would have touched it at once
    asked, _, files = _exec_pair(sandbox_server, ["/bin/sh", "-c", "echo hello >&3; cat <&4"], peer)
    assert (asked.exit_code, asked.stdout.strip()) == (0, "got hello")
    assert "peer-ran" in files


def test_a_command_whose_child_keeps_the_peer_pipe_still_ends_when_it_exits(sandbox_server):
    """The launcher watches the command's exit, not only the pipe: a background child holding fd 3
    open must not keep the exec waiting until its timeout."""
    peer = ["/bin/sh", "-c", "touch peer-ran"]
    result, seconds, files = _exec_pair(sandbox_server, ["/bin/sh", "-c", "sleep 20 & echo left"], peer, timeout_s=15)
    assert (result.exit_code, result.timed_out, result.stdout.strip()) == (0, False, "left")
    assert seconds < 10 and "peer-ran" not in files


def test_without_lazy_peer_the_peer_starts_with_the_command(sandbox_server):
    """The default: a peer that speaks first, or that nobody writes to, runs at once; a command
    that reads before it writes gets its answer, not a wait until the timeout."""
    peer = ["/bin/sh", "-c", "touch peer-ran; echo banner"]
    result, seconds, files = _exec_pair(sandbox_server, ["/bin/sh", "-c", "head -n1 <&4"], peer, timeout_s=15, lazy_peer=False)
    assert (result.exit_code, result.stdout.strip()) == (0, "banner") and seconds < 10
    silent, _, files = _exec_pair(sandbox_server, ["/bin/sh", "-c", "sleep 0.5"], peer, lazy_peer=False)
    assert silent.exit_code == 0 and "peer-ran" in files


def test_scoring_asks_for_a_lazy_peer_and_a_script_check_scores_without_one(sandbox_server):
    """The judge writes before it reads, so scoring asks for the lazy peer (seen on the wire); a
    hidden script that reads a file, which never asks the peer, still scores 1."""
    import json

    import httpx2

    class Recording(httpx2.AsyncHTTPTransport):
        execs: list[dict] = []

        async def handle_async_request(self, request):
            if request.url.path.endswith("/exec"):
                self.execs.append(json.loads(request.content))
            return await super().handle_async_request(request)

    hidden = {"hidden_check/check.py": "import sys\nsys.exit(0 if open('answer.txt').read().strip() == '7' else 1)\n"}

    async def main():
        async with SandboxClient(sandbox_server.url, sandbox_server.token, transport=Recording()) as client:
            agent = await client.create({"answer.txt": "7\n"})
            try:
                return await score_submission(client, task_files={}, hidden_files=hidden, agent_sandbox_id=agent,
                                              test_command="python hidden_check/check.py", timeout_s=30)
            finally:
                await client.delete(agent)

    result = asyncio.run(main())
    assert (result.reward, result.passed) == (1.0, True), result.output
    assert [body.get("lazy_peer") for body in Recording.execs] == [True]


def test_lazy_peer_without_a_peer_command_is_refused(sandbox_server):
    import httpx2

    async def main():
        async with SandboxClient(sandbox_server.url, sandbox_server.token) as client:
            sid = await client.create({})
            try:
                return httpx2.post(f"{sandbox_server.url}/v1/sandboxes/{sid}/exec", timeout=30,
                                   headers={"Authorization": f"Bearer {sandbox_server.token}"},
                                   json={"command": ["true"], "lazy_peer": True})
            finally:
                await client.delete(sid)

    response = asyncio.run(main())
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_request", response.text
    assert "lazy_peer needs a peer_command" in response.json()["error"]["message"]


def test_a_peer_exec_near_the_argument_cap_runs_and_one_past_it_is_a_413(sandbox_server):
    """With a peer, command, peer and environment reach the pair launcher as one argument (Linux caps
    one at 128 KiB): a command of 60 KB runs; one of 100 KB is refused before exec with a typed 413,
    not started to fail with exit 126."""
    from sandbox_client.errors import SandboxRequestError

    async def main():
        async with SandboxClient(sandbox_server.url, sandbox_server.token) as client:
            sid = await client.create({"a.txt": "x"})
            try:
                fits = await client.exec(sid, "echo " + "a" * 60_000 + " | wc -c", peer_command=["true"],
                                         timeout_s=20)
                assert fits.exit_code == 0 and fits.stdout.strip() == "60001"
                with pytest.raises(SandboxRequestError) as refused:
                    await client.exec(sid, "echo " + "a" * 100_000, peer_command=["true"], timeout_s=20)
                assert refused.value.status == 413 and refused.value.code == "payload_too_large"
                assert "peer_command" in str(refused.value)
            finally:
                await client.delete(sid)

    asyncio.run(main())
