"""Async client of several sandbox servers (``sandbox.urls``), with :class:`SandboxClient`'s calls.

A sandbox lives on one server, so a plain load balancer in front of a fleet cannot route ``exec``
or ``fork``; the routing lives here. Each guarantee, then how it is kept:

- **Placement by free capacity.** A new sandbox goes to the server with the most free slots, per
  its last health answer (``sandboxes.max - sandboxes.active``) less what this client created there
  since (plus what it deleted). Ties go to the first in ``urls``, so equal servers fill in turn.
  Health is asked again in the background every ``probe_interval_s``.
- **Routing without shared state.** The id this client returns names the server:
  ``s<index in urls>-<the server's id>``. Every later call (exec, files, fork, delete) goes to that
  server, from any process given the same ``urls``; a fork is made by the server that holds the
  original, so it lands there too.
- **Failover.** A call that ends in :class:`SandboxUnreachable` (its retries and deadlines spent)
  marks its server down: the calls for its other sandboxes fail at once with the same error (their
  episodes end ``sandbox_error``, excluded from training, counted by the circuit breaker), and no
  sandbox is placed there. A server is used again once its health call answers (after a restart
  its old sandboxes are gone: :class:`SandboxNotFound`). A health answer of the wrong shape (another
  protocol, a ``sandboxes`` count that is not a number) counts as no answer, with the reason.
- **Back-off after a failed create.** A server whose create failed (unreachable, or a 5xx through
  its retries) takes no create for ``probe_interval_s x 2^(failures - 1)`` (at most
  ``max_out_s``), even if its health answers meanwhile: a server that answers health but hangs on
  create would otherwise cost every health round one full call deadline. A create there resets it.
- **Deletes are never refused.** A delete to a server marked down is still tried, once, within
  ``timeout_s``; an id whose delete found the server unreachable is kept and deleted when its
  health next answers, so a stalled server's sandboxes do not wait for their TTL. So is the sandbox
  of a create it never answered: the same create, sent again with its idempotency key, names it.
- **Full servers.** A 429 from one server sends the create to the next (so does a 5xx that outlasted
  its retries); when every live server is full, the create waits the shortest ``Retry-After`` and asks
  again, ``max_retries`` times.
- **No server.** When none answers, a create is one :class:`SandboxUnreachable` naming each server
  and why.

    async with SandboxFleet(["http://a:8000", "http://b:8000"], token) as fleet:
        sandbox_id = await fleet.create({"utils.py": "def f(): ..."})   # "s1-9f3c..." on b
        result = await fleet.exec(sandbox_id, "python -m pytest -q", timeout_s=60)
        await fleet.delete(sandbox_id)
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from sandbox_client.client import PROTOCOL_VERSION, SandboxClient
from sandbox_client.errors import (
    SandboxAuthError,
    SandboxCapacityError,
    SandboxInfraError,
    SandboxNotFound,
    SandboxUnreachable,
)
from sandbox_client.models import ExecResult

T = TypeVar("T")
_FLEET_ID = re.compile(r"s([0-9]{1,6})-(.+)", re.ASCII)
log = logging.getLogger(__name__)


def _health_problem(answer: Any) -> str | None:
    """Why a health answer cannot place sandboxes (None: it can): not ``ok``, another protocol, or a
    ``sandboxes`` count that is not a non-negative integer (a bool is not a count)."""
    if not isinstance(answer, dict) or answer.get("status") != "ok":
        return f"not healthy: {answer!r}"[:300]
    if answer.get("protocol", PROTOCOL_VERSION) != PROTOCOL_VERSION:  # as the start-up checks read it
        return f"speaks protocol {answer.get('protocol')!r}; this client speaks {PROTOCOL_VERSION!r}"[:300]
    counts = answer.get("sandboxes")
    if counts is None:
        return None  # a server that does not report its capacity: placed on as if empty
    if not isinstance(counts, dict) or not all(
            type(counts.get(key, 0)) is int and counts.get(key, 0) >= 0 for key in ("max", "active")):
        return f"malformed health answer: sandboxes={counts!r}"[:300]
    return None


class _Server:
    """One server of the fleet and what this client knows of it."""

    def __init__(self, index: int, client: SandboxClient, probe: SandboxClient) -> None:
        self.index, self.client, self.probe = index, client, probe
        self.free = 0  # free slots: its last health answer, less this client's creates since
        self.max: int | None = None  # its last reported sandboxes.max: ``free`` never exceeds it
        self.answered = False  # its last health call answered "ok"
        self.down: str | None = None  # why its calls stopped (a call's retries ran out); None: up
        self.why = "not asked yet"  # the last health call's failure, for the all-down error
        self.create_failures = 0  # creates failed in a row: the back-off doubles with each
        self.out_until = 0.0  # monotonic time before which no create goes here
        self.undeleted: set[str] = set()  # server ids whose delete found it unreachable: retried when it answers
        self.lost_creates: list[tuple[str, dict]] = []  # (key, call) of creates whose answer never came

    @property
    def url(self) -> str:
        return self.client.base_url

    @property
    def usable(self) -> bool:
        return self.answered and self.down is None and time.monotonic() >= self.out_until


class SandboxFleet:
    """Client for several sandbox services sharing one token. Use as an async context manager."""

    def __init__(self, urls: list[str], token: str, *, probe_interval_s: float = 2.0, max_out_s: float = 300.0,
                 **client_options: Any) -> None:
        if not urls:
            raise ValueError("urls is empty")
        if len({url.rstrip("/") for url in urls}) != len(urls):
            raise ValueError(f"urls repeats a server: {urls}")
        if probe_interval_s <= 0:
            raise ValueError(f"probe_interval_s must be positive, got {probe_interval_s}")
        self.probe_interval_s, self.max_out_s = probe_interval_s, max_out_s
        self.servers = []
        for index, url in enumerate(urls):
            client = SandboxClient(url, token, **client_options)
            probe = SandboxClient(url, token, timeout_s=client.timeout_s, max_retries=0)
            self.servers.append(_Server(index, client, probe))
        first = self.servers[0].client
        self.timeout_s, self.max_retries = first.timeout_s, first.max_retries
        self._probed_at: float | None = None
        self._probing: asyncio.Task | None = None

    def __repr__(self) -> str:  # never shows the token
        return f"SandboxFleet({[server.url for server in self.servers]!r})"

    async def __aenter__(self) -> SandboxFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._probing is not None:
            self._probing.cancel()
            await asyncio.gather(self._probing, return_exceptions=True)
        for server in self.servers:
            await server.client.close()
            await server.probe.close()

    # ---- health and placement ---------------------------------------------------------------------
    async def _probe(self, server: _Server) -> dict | None:
        try:
            answer = await server.probe.health()
        except Exception as err:  # unreachable, refused, 5xx: not placeable until it answers
            self._set_answered(server, False, f"{type(err).__name__}: {err}")
            return None
        problem = _health_problem(answer)
        self._set_answered(server, problem is None, problem or "")
        if problem is None:
            if server.down is not None:
                log.warning("sandbox server %s answers again; calls go to it", server.url)
            server.down = None  # back (or never gone): calls and placement use it again
            sandboxes = answer.get("sandboxes")
            if sandboxes is not None and "max" in sandboxes:  # checked: non-negative integers
                server.max, server.free = sandboxes["max"], sandboxes["max"] - sandboxes.get("active", 0)
            await self._delete_undeleted(server)
        return answer

    @staticmethod
    def _set_answered(server: _Server, answered: bool, why: str) -> None:
        if server.answered and not answered:
            log.warning("sandbox server %s left the fleet: %s", server.url, why)
        server.answered, server.why = answered, why

    async def _delete_undeleted(self, server: _Server) -> None:
        """Delete what earlier deletes could not, now that the server answers (one try each), and what
        creates whose answer was lost made: the same create with the same key names it (or makes it now)."""
        while server.lost_creates:  # one try each: a server that hangs on create costs one deadline per lost one
            key, call = server.lost_creates.pop(0)
            try:
                server.undeleted.add(await server.probe.create(**call, wait_if_full=False, idempotency_key=key))
            except Exception:  # noqa: BLE001 - unreachable again, or refused (full, its key expired): let it go
                pass
        for raw in list(server.undeleted):
            try:
                await server.probe.delete(raw)
            except SandboxUnreachable:
                return  # gone again: the next answer tries the rest
            except Exception:  # noqa: BLE001 - 404 (its TTL or a restart took it) or another refusal: nothing to keep
                pass
            server.undeleted.discard(raw)
            self._freed(server)

    async def _probe_all(self) -> list[dict | None]:
        self._probed_at = time.monotonic()
        return list(await asyncio.gather(*(self._probe(server) for server in self.servers)))

    async def _fresh_probe(self) -> None:
        """Wait for a health round: the one under way, else a new one."""
        if self._probing is None or self._probing.done():
            self._probing = asyncio.ensure_future(self._probe_all())
        await asyncio.shield(self._probing)

    async def _candidates(self) -> list[_Server]:
        """The usable servers, most free slots first; none is one :class:`SandboxUnreachable`."""
        if self._probed_at is None:
            await self._fresh_probe()
        elif time.monotonic() - self._probed_at >= self.probe_interval_s and (
                self._probing is None or self._probing.done()):
            self._probing = asyncio.ensure_future(self._probe_all())  # in the background
        if not any(server.usable for server in self.servers):
            await self._fresh_probe()
        usable = [server for server in self.servers if server.usable]
        if not usable:  # only backed-off ones answer: try them, soonest back first, rather than fail at once
            waiting = [server for server in self.servers if server.answered and server.down is None]
            if waiting:
                return sorted(waiting, key=lambda server: server.out_until)
        if not usable:
            raise SandboxUnreachable(f"no sandbox server of {len(self.servers)} answers: " + "; ".join(
                f"{server.url}: {server.down or server.why}" for server in self.servers))
        return sorted(usable, key=lambda server: -server.free)

    async def health(self) -> dict:
        """Every server's health now; ``status`` is ``ok`` when at least one answers."""
        answers = await self._probe_all()
        servers = [{"url": server.url, "status": "ok" if server.answered else "down", "error": server.why or None,
                    "health": answer} for server, answer in zip(self.servers, answers, strict=True)]
        return {"status": "ok" if any(server.answered for server in self.servers) else "down", "servers": servers}

    async def create(self, files: dict[str, str | bytes], *, ttl_s: float | None = None, network: bool = False) -> str:
        """A new sandbox on the usable server with the most free slots; its fleet id."""
        full: list[SandboxCapacityError] = []
        failed: SandboxInfraError | None = None
        for _ in range(self.max_retries + 1):
            if full:  # every live server was full: wait as the shortest Retry-After asks
                await asyncio.sleep(min(err.retry_after_s for err in full))
            full = []
            for server in await self._candidates():  # none answers: raises, naming each
                server.free -= 1  # taken now: concurrent creates see it before this one's answer comes
                call, key = {"files": files, "ttl_s": ttl_s, "network": network}, uuid.uuid4().hex
                try:
                    raw = await server.client.create(**call, wait_if_full=False, idempotency_key=key)
                except SandboxCapacityError as err:
                    server.free = 0
                    full.append(err)
                    continue
                except SandboxUnreachable as err:  # it may still make the sandbox once it answers
                    server.free += 1
                    server.lost_creates.append((key, call))
                    self._mark_down(server, err)
                    self._back_off(server, err)
                    continue
                except SandboxInfraError as err:  # 5xx through its retries: the next server may do it
                    server.free += 1
                    if isinstance(err, SandboxAuthError):  # the fleet's one token: no other server takes it
                        raise
                    self._back_off(server, err)
                    failed = err
                    continue
                except BaseException:
                    server.free += 1
                    raise
                server.create_failures = 0
                return f"s{server.index}-{raw}"
        if failed is not None and not full:
            raise failed
        if full:
            raise SandboxCapacityError(f"every live sandbox server stayed full ({self.max_retries + 1} rounds); "
                                       f"last: {full[-1]}", status=429, code="capacity")
        raise SandboxUnreachable("every sandbox server went down while asked: " + "; ".join(
            f"{server.url}: {server.down or server.why}" for server in self.servers))

    # ---- routed calls -----------------------------------------------------------------------------
    def _mark_down(self, server: _Server, err: SandboxUnreachable) -> None:
        if server.down is None:
            log.warning("sandbox server %s is down: %s", server.url, err)
        server.down, server.answered = f"down since a call found it unreachable: {err}"[:500], False

    def _back_off(self, server: _Server, err: Exception) -> None:
        """No create on ``server`` for ``probe_interval_s x 2^(failures - 1)`` s, at most ``max_out_s``."""
        server.create_failures += 1
        out_s = min(self.max_out_s, self.probe_interval_s * 2.0 ** min(server.create_failures - 1, 30))
        server.out_until = time.monotonic() + out_s
        log.warning("sandbox server %s takes no create for %.1f s (%d failed in a row): %s", server.url, out_s,
                    server.create_failures, str(err)[:200])

    @staticmethod
    def _freed(server: _Server) -> None:
        """One slot back; never more than the server's last reported ``max``."""
        server.free = server.free + 1 if server.max is None else min(server.free + 1, server.max)

    @property
    def live_servers(self) -> int:
        """How many servers take sandboxes now (answered, not down, not backed off)."""
        return sum(server.usable for server in self.servers)

    def _route(self, sandbox_id: str) -> tuple[_Server, str]:
        match = _FLEET_ID.fullmatch(sandbox_id)
        if match is None or int(match[1]) >= len(self.servers):
            raise SandboxNotFound(f"no sandbox {sandbox_id[:80]!r}: its id names no server of this fleet "
                                  f"(s0..s{len(self.servers) - 1})", status=404, code="sandbox_not_found")
        return self.servers[int(match[1])], match[2]

    async def _routed(self, sandbox_id: str, call: Callable[[SandboxClient, str], Awaitable[T]]) -> T:
        """``call(client, server's id)`` on the server holding ``sandbox_id``."""
        server, raw = self._route(sandbox_id)
        if server.down is not None:
            raise SandboxUnreachable(f"sandbox {sandbox_id} is on {server.url}, {server.down}")
        try:
            return await call(server.client, raw)
        except SandboxUnreachable as err:
            self._mark_down(server, err)
            raise SandboxUnreachable(f"{server.url}: {err}") from err

    async def exec(self, sandbox_id: str, command: str | list[str], **options: Any) -> ExecResult:
        return await self._routed(sandbox_id, lambda client, raw: client.exec(raw, command, **options))

    async def read_bytes(self, sandbox_id: str, path: str) -> bytes:
        return await self._routed(sandbox_id, lambda client, raw: client.read_bytes(raw, path))

    async def read_file(self, sandbox_id: str, path: str) -> str:
        return await self._routed(sandbox_id, lambda client, raw: client.read_file(raw, path))

    async def write_file(self, sandbox_id: str, path: str, content: str | bytes) -> None:
        await self._routed(sandbox_id, lambda client, raw: client.write_file(raw, path, content))

    async def list_files(self, sandbox_id: str) -> list[str]:
        return await self._routed(sandbox_id, lambda client, raw: client.list_files(raw))

    async def fork(self, sandbox_id: str) -> str:
        """A copy of the sandbox, on the server that holds it."""
        server, _ = self._route(sandbox_id)
        server.free -= 1
        try:
            copy = await self._routed(sandbox_id, lambda client, raw: client.fork(raw))
        except BaseException:
            server.free += 1
            raise
        return f"s{server.index}-{copy}"

    async def delete(self, sandbox_id: str) -> None:
        """Delete it; tried even when its server is marked down (once, within ``timeout_s``). One the server
        cannot be reached for is remembered and deleted when its health next answers."""
        server, raw = self._route(sandbox_id)
        client = server.client if server.down is None else server.probe
        try:
            await client.delete(raw)
        except SandboxUnreachable as err:
            server.undeleted.add(raw)
            self._mark_down(server, err)
            raise SandboxUnreachable(f"{server.url}: {err} (deleted when it answers again)") from err
        self._freed(server)
