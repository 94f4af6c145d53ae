"""`sandbox.urls`: training on a fleet of sandbox servers (real servers over loopback, real `fit`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import httpx2
import pytest

from lightning_agentrl.train import fit
from sandbox_server.launch import start_local_server
from tests.failing import DEAD, error_line, serve
from tests.fitting import SOLVE, StepLog, TeacherForcedEngine, learn_settings


def created(server) -> int:
    """``sandbox_created_total`` of a server's metrics: the sandboxes it made since it started."""
    text = httpx2.get(f"{server.url}/v1/metrics", headers={"Authorization": f"Bearer {server.token}"}).text
    counts = [line.split()[-1] for line in text.splitlines() if line.startswith("sandbox_created_total ")]
    return int(float(counts[0])) if counts else 0  # a counter appears at its first count


def episodes(run: Path, step: int) -> list[dict]:
    return [json.loads(line) for line in (run / "trajectories" / f"step_{step:06d}.jsonl").read_text().splitlines()]


class ServerChaos:
    """Plays the solving script and, on the rollout thread, SIGKILLs ``servers[victim]`` at the first turn-2
    action of policy version 1 or 2 while episodes hold sandboxes on it, and restarts it on the same port at
    the first action of the next version (two steps later, the fleet's health round has seen it back)."""

    def __init__(self, engine, servers: list, victim: int, starter) -> None:
        self.engine, self.servers, self.victim = engine, servers, victim
        self.starter = starter  # a thread that outlives the run: a server dies with the thread that started it
        self.spread_before_kill: list[int] | None = None
        self.killed_at: int | None = None  # the policy version (= step) whose episodes lost their server
        self._turns: dict[str, int] = {}

    @property
    def policy_version(self) -> int:
        return self.engine.policy_version

    async def generate(self, prompt_ids, sampling, session_id):
        turn = self._turns[session_id] = self._turns.get(session_id, 0) + 1
        server, version = self.servers[self.victim], self.policy_version
        if (self.killed_at is None and 1 <= version <= 2 and turn == 2
                and server.health()["sandboxes"]["active"] > 0):
            self.spread_before_kill = [created(s) for s in self.servers]
            self.killed_at = version
            server.process.kill()  # SIGKILL: no goodbye, its sandboxes are lost
            server.process.wait()
        if self.killed_at is not None and version > self.killed_at and server.process.poll() is not None:
            port = int(server.url.rsplit(":", 1)[1])
            self.servers[self.victim] = self.starter.submit(start_local_server, port=port, token=server.token).result()
        return await self.engine.generate(prompt_ids, sampling, session_id)

    async def update_weights(self, named_tensors, version):
        await self.engine.update_weights(named_tensors, version)

    async def close(self):
        await self.engine.close()


def test_fit_on_three_servers_goes_on_when_one_is_killed_and_uses_it_again_once_restarted(tmp_path):
    from transformers import AutoTokenizer

    from lightning_agentrl.rollout.chat import ChatCodec
    from lightning_agentrl.train import resolve_model_path

    first = start_local_server()
    servers = [first, start_local_server(token=first.token), start_local_server(token=first.token)]
    victim_url = servers[2].url
    chaos = None

    def wrap(engine):
        nonlocal chaos
        codec = ChatCodec(AutoTokenizer.from_pretrained(resolve_model_path(settings)))
        chaos = ServerChaos(TeacherForcedEngine(engine, codec, {"*": SOLVE}), servers, victim=2, starter=starter)
        return chaos

    settings = learn_settings(tmp_path, f"--sandbox.urls={json.dumps([s.url for s in servers])}",
                              f"--sandbox.token={first.token}", "--trainer.max_steps=6", "--rollout.group_size=3",
                              "--rollout.max_in_flight=6")
    log = StepLog()
    starter = ThreadPoolExecutor(max_workers=1)
    try:
        result = fit(settings, callbacks=[log], wrap_engine=wrap)
        after_restart = created(servers[2])
    finally:
        for server in servers:
            server.stop()
        starter.shutdown()
    assert result.global_step == 6
    assert chaos.killed_at is not None, "no episode held a sandbox on the victim at a turn-2 action of steps 1-2"
    assert all(count > 0 for count in chaos.spread_before_kill), chaos.spread_before_kill  # all three were used
    run, step = settings.run.dir, chaos.killed_at
    lost = [e for e in episodes(run, step) if e["termination"] == "sandbox_error"]
    assert 0 < len(lost) < 6 and all(victim_url in e["info"]["sandbox_error"] for e in lost), [e["info"] for e in lost]
    assert log.metrics[step]["termination/sandbox_error"] == len(lost)  # counted, and the breaker stayed closed
    assert log.metrics[step]["filter/infra_error_frac_window"] == pytest.approx(len(lost) / (6 * (step + 1)))
    # the run went on with the other two: every other episode scored, then and afterwards
    for index in range(6):
        kept = [e for e in episodes(run, index) if e["termination"] != "sandbox_error"]
        assert [e["reward"] for e in kept] == [1.0] * len(kept) and len(kept) == (6 if index != step else 6 - len(lost))
    assert after_restart > 0, step  # the restarted server took new sandboxes


# -- the client on its own, against real servers ------------------------------------------------------
@pytest.fixture(scope="module")
def three_servers():
    first = start_local_server(max_sandboxes=2)
    servers = [first, *(start_local_server(max_sandboxes=2, token=first.token) for _ in range(2))]
    yield servers
    for server in servers:
        server.stop()


def fleet_of(servers, **options):
    from sandbox_client import SandboxFleet

    options = {"timeout_s": 5, "max_retries": 1, "backoff_s": 0.05, "probe_interval_s": 0.2, **options}
    return SandboxFleet([s.url for s in servers], servers[0].token, **options)


def test_a_fleet_places_by_free_slots_routes_by_id_forks_in_place_and_refuses_when_every_server_is_full(three_servers):
    import asyncio

    async def main():
        async with fleet_of(three_servers) as fleet:
            ids = [await fleet.create({"n.txt": str(i)}) for i in range(3)]
            copy = await fleet.fork(ids[1])  # s1 is now full (2 of 2)
            more = [await fleet.create({"n.txt": "x"}) for _ in range(2)]  # s0 and s2 have one slot each
            reads = [await fleet.read_file(i, "n.txt") for i in (*ids, copy)]
            try:
                await fleet.create({})  # every server full: one error after its rounds
            except Exception as err:  # noqa: BLE001 - the type is asserted below
                refused = err
            for sandbox_id in (*ids, copy, *more):
                await fleet.delete(sandbox_id)
            return ids, copy, more, reads, refused

    ids, copy, more, reads, refused = asyncio.run(main())
    assert [i.split("-")[0] for i in ids] == ["s0", "s1", "s2"]  # equal servers fill in turn
    assert copy.startswith("s1-") and reads == ["0", "1", "2", "1"]
    assert sorted(i.split("-")[0] for i in more) == ["s0", "s2"]  # the full s1 was passed over
    assert type(refused).__name__ == "SandboxCapacityError" and "every live sandbox server stayed full" in str(refused)


def test_a_fleet_without_a_live_server_is_one_error_naming_each(three_servers):
    import asyncio
    import socket

    from sandbox_client import SandboxUnreachable

    dead = []
    for _ in range(2):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead.append(type("Dead", (), {"url": f"http://127.0.0.1:{sock.getsockname()[1]}",
                                           "token": three_servers[0].token})())

    async def main():
        async with fleet_of(dead) as fleet:
            await fleet.create({})

    with pytest.raises(SandboxUnreachable, match="no sandbox server of 2 answers: ") as caught:
        asyncio.run(main())
    assert all(server.url in str(caught.value) for server in dead)


def test_the_protocol_conformance_suite_passes_against_each_server_of_a_fleet(three_servers):
    from tests.fitting import REPO

    urls = ",".join(server.url for server in three_servers)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/sandbox_conformance/test_protocol.py",
         "--sandbox-url", urls, f"--sandbox-token={three_servers[0].token}", "-rA"],
        cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stdout[-3000:]
    passed = [line for line in done.stdout.splitlines() if line.startswith("PASSED ")]
    per_server = [sum(server.url in line for line in passed) for server in three_servers]
    assert per_server[0] >= 9 and per_server == [per_server[0]] * 3 and len(passed) == sum(per_server), per_server



class _JsonHandler(BaseHTTPRequestHandler):
    """A fake sandbox service's request handler: JSON answers, no access log."""

    def _answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

class _OtherProtocol:
    """A service whose health answers in another protocol version."""

    def __init__(self) -> None:
        class Handler(_JsonHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                self._answer(200, b'{"status": "ok", "protocol": "v2"}')


        self.server, self.url = serve(Handler)


def test_start_up_checks_probe_every_server_and_name_each_that_fails(three_servers, capsys):
    from lightning_agentrl.__main__ import main

    other = _OtherProtocol()
    good = [server.url for server in three_servers]
    args = ["validate", "--config", "tests/fixtures/tiny_bugfix.yaml", f"--sandbox.token={three_servers[0].token}"]
    assert main([*args, f"--sandbox.urls={json.dumps(good)}"]) == 0
    capsys.readouterr()
    assert main([*args, f"--sandbox.urls={json.dumps([good[0], DEAD, other.url])}"]) == 2
    line = error_line(capsys.readouterr().err)
    other.server.shutdown()
    assert line.startswith("error: sandbox.urls: 2 of 3 sandbox servers failed the start-up checks: ")
    assert f"sandbox.urls: the sandbox service at {DEAD} does not answer its health call" in line
    assert f"sandbox.urls: the sandbox service at {other.url} speaks protocol 'v2'; this client speaks 'v1'" in line
    assert good[0] not in line
    assert main([*args[:3], "--sandbox.token=wrong", f"--sandbox.urls={json.dumps(good[:2])}"]) == 2
    line = error_line(capsys.readouterr().err)
    assert all(f"sandbox.token: the sandbox service at {url} refused it" in line for url in good[:2]), line


@pytest.mark.parametrize(("override", "message"), [
    ('--sandbox.urls=["http://a:1"] --sandbox.url=http://b:1', "sandbox.urls: set it or sandbox.url, not both "
     "(sandbox.url is the one-server case; unset the one a config file sets with --sandbox.urls=[] or"),
    ('--sandbox.urls=["a:1"]', "sandbox.urls: 'a:1' is not a base URL like http://10.0.0.5:8000"),
    ('--sandbox.urls=["http://a:99999"]', "sandbox.urls: 'http://a:99999' is not a base URL"),
    ('--sandbox.urls=["http://a:1","http://a:1/"]', "sandbox.urls lists a server twice"),
    ('--sandbox.urls=["http://A:1","HTTP://a:01"]', "sandbox.urls lists a server twice"),
    ('--sandbox.urls=["http://a","http://a:80"]', "sandbox.urls lists a server twice"),
    ('--engine.kind=vllm_server --engine.urls=["http://[::1]:1","http://[::1]:1/"]', "engine.urls lists a server twice"),
])
def test_sandbox_urls_that_cannot_work_are_refused_before_anything_starts(override, message):
    from lightning_agentrl.settings import load_settings

    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(".", r"\.").replace("[", r"\[")):
        load_settings(None, override.split(" "))


def test_sandbox_urls_take_bracketed_ipv6_hosts_and_tell_servers_apart_by_scheme_and_port():
    from lightning_agentrl.settings import load_settings

    urls = ["http://[::1]:8000", "http://[fd00::5]:8000/", "https://a:8000", "http://a:8000", "http://a:8001"]
    assert load_settings(None, [f"--sandbox.urls={json.dumps(urls)}"]).sandbox.urls == urls


class _FailingCreates:
    """A service that says it is healthy with 10 free slots and answers every create with a 500."""

    def __init__(self) -> None:
        class Handler(_JsonHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                self._answer(200, b'{"status": "ok", "protocol": "v1", "sandboxes": {"active": 0, "max": 10}}')

            def do_POST(self):  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                self._answer(500, b'{"error": {"code": "internal", "message": "broken"}}')


        self.server, self.url = serve(Handler)
        self.token = "x"


def test_a_create_that_one_server_fails_through_its_retries_goes_to_the_next(three_servers):
    import asyncio

    broken = _FailingCreates()
    broken.token = three_servers[0].token

    async def main():
        async with fleet_of([broken, three_servers[0]]) as fleet:
            sandbox_id = await fleet.create({"a.txt": "a"})  # the broken one has the most free slots
            text = await fleet.read_file(sandbox_id, "a.txt")
            await fleet.delete(sandbox_id)
            return sandbox_id, text

    sandbox_id, text = asyncio.run(main())
    broken.server.shutdown()
    assert sandbox_id.startswith("s1-") and text == "a"


def test_a_429_from_a_server_another_process_filled_sends_the_create_to_the_next_at_once(three_servers):
    import asyncio
    import time

    from sandbox_client import SandboxClient

    async def main():
        async with fleet_of(three_servers, probe_interval_s=600) as fleet:  # its health picture stays stale
            await fleet.delete(await fleet.create({}))  # the one health round: every server empty
            async with SandboxClient(three_servers[0].url, three_servers[0].token) as other:
                filled = [await other.create({}) for _ in range(2)]  # another process fills s0
                start = time.monotonic()
                sandbox_id = await fleet.create({})  # s0 looks emptiest here, answers 429
                elapsed = time.monotonic() - start
                await fleet.delete(sandbox_id)
                for other_id in filled:
                    await other.delete(other_id)
            return sandbox_id, elapsed

    sandbox_id, elapsed = asyncio.run(main())
    assert not sandbox_id.startswith("s0-")
    assert elapsed < 1.5  # not after the server's Retry-After (2 s)


class _FakeServer:
    """A service answering health with ``health`` (bytes, or a callable giving them) and every create with a 500
    (``create="fail"``), never (``create="hang"``) or a new id (``create="ok"``); every delete with a 204."""

    def __init__(self, health, create: str = "fail", token: str = "x") -> None:
        import time
        self.creates, self.token, self.keys = 0, token, set()
        outer = self

        class Handler(_JsonHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                self._answer(200, health() if callable(health) else health)

            def do_POST(self):  # noqa: N802
                outer.keys.add(json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))["idempotency_key"])
                outer.creates += 1
                if create == "hang":
                    time.sleep(30)
                if create == "ok":
                    return self._answer(201, json.dumps({"id": f"f{outer.creates}"}).encode())
                self._answer(500, b'{"error": {"code": "internal", "message": "broken"}}')

            def do_DELETE(self):  # noqa: N802
                self._answer(204, b"")


        self.server, self.url = serve(Handler)


@pytest.mark.parametrize("sandboxes", ['{"active": "n/a", "max": 8}', '{"active": [1], "max": 8}',
                                       '{"active": 0, "max": true}', '[1]'])
def test_a_server_whose_health_answer_is_malformed_is_left_out_with_the_reason(three_servers, sandboxes):
    import asyncio

    odd = _FakeServer(f'{{"status": "ok", "protocol": "v1", "sandboxes": {sandboxes}}}'.encode(),
                      token=three_servers[0].token)

    async def main():
        async with fleet_of([odd, three_servers[0]]) as fleet:
            sandbox_id = await fleet.create({})
            await fleet.delete(sandbox_id)
            return sandbox_id, (await fleet.health())["servers"][0]["error"]

    sandbox_id, why = asyncio.run(main())
    odd.server.shutdown()
    assert sandbox_id.startswith("s1-") and odd.creates == 0
    assert why.startswith("malformed health answer: sandboxes="), why


def test_a_server_that_later_speaks_another_protocol_takes_no_sandbox(three_servers):
    import asyncio

    said = {"protocol": "v1"}
    health = lambda: json.dumps({"status": "ok", "protocol": said["protocol"],  # noqa: E731
                                 "sandboxes": {"active": 0, "max": 50}}).encode()
    other = _FakeServer(health, token=three_servers[0].token)

    async def main():
        async with fleet_of([other, three_servers[0]]) as fleet:
            await fleet.health()  # v1 at first: the emptiest server
            said["protocol"] = "v2"
            why = (await fleet.health())["servers"][0]["error"]  # the next health round sees v2
            sandbox_id = await fleet.create({})
            await fleet.delete(sandbox_id)
            return sandbox_id, why

    sandbox_id, why = asyncio.run(main())
    other.server.shutdown()
    assert sandbox_id.startswith("s1-") and other.creates == 0
    assert why == "speaks protocol 'v2'; this client speaks 'v1'"


def test_a_server_that_stalls_past_the_deadline_gets_every_delete_and_ends_empty(three_servers):
    import asyncio
    import signal

    from sandbox_client import SandboxUnreachable

    first, second = three_servers[0], three_servers[1]

    async def main():
        async with fleet_of([first, second], timeout_s=1, max_retries=0) as fleet:
            ids = [await fleet.create({}) for _ in range(2)]  # one on each
            os.kill(first.process.pid, signal.SIGSTOP)
            try:
                ids.append(await fleet.create({}))  # tried on the stalled s0 (a tie), made there later; placed on s1
                with pytest.raises(SandboxUnreachable, match="deleted when it answers again"):
                    await fleet.delete(ids[0])  # down, tried anyway, still stalled: remembered
            finally:
                os.kill(first.process.pid, signal.SIGCONT)
            for sandbox_id in ids[1:]:
                await fleet.delete(sandbox_id)
            await fleet.health()  # s0 answers: the remembered delete and the lost create's sandbox go
            return ids, [s.health()["sandboxes"]["active"] for s in (first, second)], [s.free for s in fleet.servers]

    ids, active, free = asyncio.run(main())
    assert ids[2].startswith("s1-") and active == [0, 0] and free == [2, 2]


def test_a_server_that_hangs_on_create_is_kept_out_for_a_growing_back_off(three_servers):
    import asyncio
    import time

    hung = _FakeServer(b'{"status": "ok", "protocol": "v1", "sandboxes": {"active": 0, "max": 50}}', create="hang",
                       token=three_servers[0].token)

    async def main():
        async with fleet_of([hung, three_servers[0]], timeout_s=1, max_retries=0, probe_interval_s=3) as fleet:
            tried, out_s = [], []

            async def create_after_a_health_round() -> None:
                await fleet.health()  # the hung server answers "ok" each time (and is sent the lost create again)
                await fleet.delete(await fleet.create({}))  # it has the most free slots
                tried.append(len(hung.keys))  # creates, not counting a lost one sent again with its key
                out_s.append(round(fleet.servers[0].out_until - time.monotonic()))

            await create_after_a_health_round()  # tried, failed: out 3 s
            await create_after_a_health_round()  # kept out although its health answered
            await asyncio.sleep(3.1)
            await create_after_a_health_round()  # tried again, failed again: out 6 s
            await create_after_a_health_round()
            return tried, out_s, fleet.live_servers

    tried, out_s, live = asyncio.run(main())
    hung.server.shutdown()
    assert tried == [1, 1, 2, 2] and out_s[2] == 6 and live == 1, (tried, out_s)
    assert hung.creates == 4  # each lost create sent again once, at the next health answer


def test_an_id_with_a_huge_or_odd_server_number_is_not_found(three_servers):
    import asyncio

    from sandbox_client import SandboxNotFound

    async def main():
        async with fleet_of(three_servers) as fleet:
            for bad in ("s" + "9" * 5000 + "-x", "s\u0661-x", "s-1-x", "s0-", "s0-x\n"):
                for call in (fleet.delete(bad), fleet.fork(bad), fleet.exec(bad, "true")):
                    with pytest.raises(SandboxNotFound, match="its id names no server of this fleet"):
                        await call

    asyncio.run(main())


def test_free_slots_never_exceed_the_servers_reported_max():
    import asyncio

    lagging = _FakeServer(b'{"status": "ok", "protocol": "v1", "sandboxes": {"active": 0, "max": 2}}', create="ok")

    async def main():
        async with fleet_of([lagging]) as fleet:
            ids = [await fleet.create({}) for _ in range(2)]
            await fleet.health()  # its count lags the two creates: 2 free
            for sandbox_id in ids:
                await fleet.delete(sandbox_id)
            return fleet.servers[0].free

    free = asyncio.run(main())
    lagging.server.shutdown()
    assert free == 2


def test_scoring_with_a_full_holding_server_snapshots_fresh_on_another(three_servers):
    import asyncio

    from sandbox_client import SandboxClient, score_submission

    task = {"m.py": "X = 1\n"}
    hidden = {"hidden_tests/test_h.py": "from m import X\n\ndef test_x():\n    assert X == 1\n"}

    async def main():
        async with fleet_of(three_servers[:2], max_retries=0) as fleet:
            agent = await fleet.create(task)  # on s0
            async with SandboxClient(three_servers[0].url, three_servers[0].token) as other:
                filler = await other.create({})  # another process fills s0 (2 of 2)
                try:
                    return agent, await score_submission(fleet, task_files=task, hidden_files=hidden,
                                                         agent_sandbox_id=agent, timeout_s=60,
                                                         test_command="python -m pytest -q hidden_tests")
                finally:
                    await other.delete(filler)
                    await fleet.delete(agent)

    agent, result = asyncio.run(main())
    assert agent.startswith("s0-") and result.snapshot == "fresh" and result.reward == 1.0, result


def test_fit_goes_on_when_one_server_answers_health_with_a_malformed_count(tmp_path, three_servers):
    """One server of two says ``"active": "n/a"``: left out, with the reason; every sandbox goes to the other."""
    odd = _FakeServer(b'{"status": "ok", "protocol": "v1", "sandboxes": {"active": "n/a", "max": 8}}',
                      token=three_servers[0].token)
    good = three_servers[0]
    before = created(good)
    settings = learn_settings(tmp_path, f"--sandbox.urls={json.dumps([good.url, odd.url])}",
                              f"--sandbox.token={good.token}", "--trainer.max_steps=1")
    log = StepLog()
    try:
        result = fit(settings, callbacks=[log])
    finally:
        odd.server.shutdown()
    terminations = [e["termination"] for e in episodes(settings.run.dir, 0)]
    assert result.global_step == 1 and "sandbox_error" not in terminations and len(terminations) == 4
    assert odd.creates == 0 and created(good) - before >= 4  # each episode's sandbox (and its scoring copy)
    assert log.metrics[0]["sandbox/servers_live"] == 1.0
