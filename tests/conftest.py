"""Shared fixtures: the tiny local model (built once per machine, cached)."""

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
