"""Shared fixtures: the tiny local model (built once per machine, cached) and a local sandbox server."""

from __future__ import annotations

from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def pytest_addoption(parser: pytest.Parser) -> None:
    # The sandbox conformance suite's options, registered here so `pytest tests` accepts them too.
    parser.addoption("--sandbox-url", default=None, help="base URL of the sandbox service under test")
    parser.addoption("--sandbox-token", default=None, help="bearer token for --sandbox-url")
    parser.addoption("--sandbox-isolation", default="auto", help="backend of the local reference server")


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from lightning_agentrl.models.tiny import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "lightning_agentrl")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)


@pytest.fixture(scope="session")
def sandbox_server():
    """One local reference sandbox server for the session (default options: the isolation backend the host
    allows); a test that needs other options or kills its server starts its own."""
    from sandbox_server.launch import start_local_server

    with start_local_server() as server:
        yield server
