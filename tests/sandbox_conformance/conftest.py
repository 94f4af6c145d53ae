"""Sandbox protocol conformance suite: runs against any server speaking protocol v1.

    pytest tests/sandbox_conformance --sandbox-url http://host:port --sandbox-token=T
    SANDBOX_URL=... SANDBOX_TOKEN=... pytest tests/sandbox_conformance

A fleet sharing one token (what ``sandbox.urls`` names) is checked server by server: give the URLs
comma-separated, ``--sandbox-url http://a:8000,http://b:8000``, and every test runs against each.

Without a URL, a local reference server is started for the session (``--sandbox-isolation`` picks its
backend: auto, bwrap or process).
"""

from __future__ import annotations

import os

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    try:
        parser.addoption("--sandbox-url", default=None, help="base URL of the sandbox service under test")
        parser.addoption("--sandbox-token", default=None, help="bearer token for --sandbox-url")
        parser.addoption("--sandbox-isolation", default="auto", help="backend of the local reference server")
    except ValueError:  # already registered by a root conftest
        pass


def _urls(config: pytest.Config) -> list[str]:
    given = config.getoption("--sandbox-url", default=None) or os.environ.get("SANDBOX_URL") or ""
    return [url.strip() for url in given.split(",") if url.strip()]


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    urls = _urls(metafunc.config)
    if len(urls) > 1 and "endpoint" in metafunc.fixturenames:  # one run of each test per server
        metafunc.parametrize("endpoint", urls, indirect=True, scope="session")


@pytest.fixture(scope="session")
def endpoint(request: pytest.FixtureRequest):
    """(url, token) of the service under test."""
    url = getattr(request, "param", None) or next(iter(_urls(request.config)), None)
    token = request.config.getoption("--sandbox-token", default=None) or os.environ.get("SANDBOX_TOKEN")
    if url:
        if not token:
            raise pytest.UsageError("--sandbox-url needs --sandbox-token (or SANDBOX_TOKEN)")
        yield url.rstrip("/"), token
        return
    from sandbox_server.launch import start_local_server

    isolation = request.config.getoption("--sandbox-isolation", default=None) or "auto"
    with start_local_server(isolation=isolation, output_limit_bytes=64 << 10, max_request_bytes=4 << 20,
                            max_file_bytes=1 << 20, address_space_bytes=1 << 30, max_processes=256,
                            memory_bytes=768 << 20, disk_bytes=64 << 20, tmp_bytes=32 << 20) as server:
        yield server.url, server.token


@pytest.fixture
def run(endpoint):
    """``run(body, **client_options)``: call ``await body(client)`` in a fresh event loop and client."""
    import asyncio

    from sandbox_client import SandboxClient

    url, token = endpoint

    def runner(body, **options):
        async def main():
            async with SandboxClient(url, token, **options) as client:
                return await body(client)

        return asyncio.run(main())

    return runner


@pytest.fixture(scope="session")
def health(endpoint) -> dict:
    import httpx2

    url, token = endpoint
    response = httpx2.get(f"{url}/v1/health", headers={"Authorization": f"Bearer {token}"}, timeout=30)
    response.raise_for_status()
    return response.json()
