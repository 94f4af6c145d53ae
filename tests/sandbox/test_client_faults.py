"""Client retry and error classification, with faults injected at the client's HTTP edge (MockTransport)."""

from __future__ import annotations

import asyncio
import json

import httpx2
import pytest

from sandbox_client import (
    CommandTimeout,
    SandboxAnswerDropped,
    SandboxAuthError,
    SandboxCapacityError,
    SandboxClient,
    SandboxInfraError,
    SandboxNotFound,
    SandboxRequestError,
)

EXEC_OK = {"exit_code": 0, "stdout": "ok\n", "stderr": "", "timed_out": False, "truncated": False,
           "duration_s": 0.01}


def _error(status: int, code: str, headers: dict | None = None) -> httpx2.Response:
    return httpx2.Response(status, json={"error": {"code": code, "message": code}}, headers=headers)


def _client(responses, seen: list, **options) -> SandboxClient:
    """Answer each request with the next item of ``responses`` (a Response, or an exception to raise)."""
    queue = list(responses)

    def handler(request: httpx2.Request) -> httpx2.Response:
        seen.append(request)
        item = queue.pop(0)
        if isinstance(item, Exception):
            raise item
        return item

    options = {"max_retries": 3, "backoff_s": 0.001, **options}
    return SandboxClient("http://sandbox.test", "tok", transport=httpx2.MockTransport(handler), **options)


def run(coro):
    return asyncio.run(coro)


def test_exec_retries_5xx_and_resets_with_the_same_idempotency_key():
    seen: list[httpx2.Request] = []

    async def main():
        async with _client([_error(503, "busy"), httpx2.ReadError("connection reset"), _error(502, "bad gateway"),
                            httpx2.Response(200, json=EXEC_OK)], seen) as client:
            return await client.exec("a" * 32, "true")

    assert run(main()).stdout == "ok\n"
    keys = {json.loads(r.content)["idempotency_key"] for r in seen}
    assert len(seen) == 4 and len(keys) == 1


def test_429_honours_retry_after(monkeypatch):
    seen: list[httpx2.Request] = []
    sleeps: list[float] = []
    real_sleep = asyncio.sleep

    async def record(delay):
        sleeps.append(delay)
        await real_sleep(0)

    monkeypatch.setattr("sandbox_client.client.asyncio.sleep", record)

    async def main():
        async with _client([_error(429, "capacity", {"Retry-After": "7"}), httpx2.Response(201, json={"id": "x" * 32})],
                           seen) as client:
            return await client.create({"a.py": "x"})

    assert run(main()) == "x" * 32
    assert sleeps == [7.0]


def test_persistent_faults_become_infra_errors_after_bounded_retries():
    seen: list[httpx2.Request] = []

    async def main(responses, **options):
        async with _client(responses, seen, **options) as client:
            await client.list_files("a" * 32)

    with pytest.raises(SandboxInfraError, match="after 3 attempts"):
        run(main([_error(500, "internal")] * 3, max_retries=2))
    with pytest.raises(SandboxInfraError, match="unreachable"):
        run(main([httpx2.ConnectError("refused")] * 3, max_retries=2))
    with pytest.raises(SandboxCapacityError):
        run(main([_error(429, "capacity", {"Retry-After": "0"})] * 2, max_retries=1))
    assert len(seen) == 8


@pytest.mark.parametrize("response,error", [
    (_error(404, "sandbox_not_found"), SandboxNotFound),
    (_error(404, "file_not_found"), SandboxRequestError),
    (_error(400, "path_escape"), SandboxRequestError),
    (_error(413, "payload_too_large"), SandboxRequestError),
    (_error(401, "unauthorized"), SandboxAuthError),
    (_error(422, "idempotency_key_reused"), SandboxInfraError),
    (_error(410, "answer_dropped"), SandboxAnswerDropped),
])
def test_client_errors_are_classified_without_retry(response, error):
    seen: list[httpx2.Request] = []

    async def main():
        async with _client([response], seen) as client:
            await client.read_file("a" * 32, "x.py")

    with pytest.raises(error):
        run(main())
    assert len(seen) == 1
    assert issubclass(SandboxNotFound, SandboxInfraError) and not issubclass(SandboxRequestError, SandboxInfraError)


def test_timed_out_exec_raises_command_timeout_with_partial_result():
    seen: list[httpx2.Request] = []
    partial = {**EXEC_OK, "exit_code": -9, "stdout": "partial", "timed_out": True}

    async def main():
        async with _client([httpx2.Response(200, json=partial)], seen) as client:
            await client.exec("a" * 32, "sleep 99", timeout_s=1)

    with pytest.raises(CommandTimeout) as caught:
        run(main())
    assert caught.value.result.stdout == "partial" and caught.value.result.exit_code == -9


def test_nonzero_exit_is_a_result_not_an_error():
    seen: list[httpx2.Request] = []

    async def main():
        async with _client([httpx2.Response(200, json={**EXEC_OK, "exit_code": 2})], seen) as client:
            return await client.exec("a" * 32, "false")

    assert run(main()).exit_code == 2


def test_delete_whose_first_answer_was_lost_succeeds():
    seen: list[httpx2.Request] = []

    async def main():
        async with _client([httpx2.ReadError("reset after delete"), _error(404, "sandbox_not_found")], seen) as client:
            await client.delete("a" * 32)

    run(main())
    assert len(seen) == 2


def test_constructor_rejects_bad_options():
    with pytest.raises(ValueError, match="max_retries"):
        SandboxClient("http://x", "t", max_retries=-1)
    with pytest.raises(ValueError, match="token"):
        SandboxClient("http://x", "")


@pytest.mark.parametrize("body", [b"\xff\xfe not json", b"[1, 2]", b'{"no_id": 1}'])
def test_an_answer_that_is_not_the_protocols_is_an_infrastructure_error(body):
    """A service that answers 2xx with garbage is broken: the episode is excluded (and counted by the
    circuit breaker), never a raw decode error that stops the run."""

    async def main():
        async with _client([httpx2.Response(201, content=body)] * 2 + [httpx2.Response(200, content=body)], []) as c:
            with pytest.raises(SandboxInfraError, match="not the protocol's"):
                await c.create({"a.py": ""})
            with pytest.raises(SandboxInfraError, match="not the protocol's"):
                await c.fork("a" * 32)
            with pytest.raises(SandboxInfraError, match="not the protocol's"):
                await c.list_files("a" * 32)

    run(main())
