"""The runnable examples in the algorithm docstrings stay true."""

from __future__ import annotations

import doctest

import pytest

from lightning_agentrl.algorithms import advantages, importance, logprobs


@pytest.mark.parametrize("module", [advantages, importance, logprobs], ids=lambda m: m.__name__)
def test_docstring_examples(module):
    result = doctest.testmod(module, raise_on_error=False, verbose=False)
    assert result.attempted > 0 and result.failed == 0
