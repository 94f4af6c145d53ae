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


# `make test` spreads the tests over one pytest-xdist worker a core (`-n auto --dist loadgroup`), one test at
# a time, except the tests of these modules: their module-scoped fixtures (most of them whole training
# runs) are built once, on the one worker that runs the module.
MODULE_FIXTURES = {
    "test_scale_out.py", "test_combinations.py", "test_fit.py", "test_evaluate.py", "test_real_models.py",
    "test_distributed.py", "test_tasks.py", "test_module.py", "sandbox/test_scoring.py",
    "sandbox/test_scoring_adversarial.py", "rollout/test_chat_templates.py", "rollout/test_sampling.py",
    "rollout/test_torch_engine.py", "rollout/test_vllm_engine.py",
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    tests = Path(__file__).parent
    for item in items:
        module = item.path.relative_to(tests).as_posix() if item.path.is_relative_to(tests) else None
        if module in MODULE_FIXTURES:
            item.add_marker(pytest.mark.xdist_group(module))


@pytest.fixture(scope="session")
def tiny_model_path() -> Path:
    from lightning_agentrl.models.tiny import build_tiny_model

    return build_tiny_model(REPO / ".cache" / "lightning_agentrl")


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_path)
