import pytest

from rpn import evaluate


def test_add_mul():
    assert evaluate("3 4 + 2 *") == 14


def test_single_number():
    assert evaluate("42") == 42


def test_malformed():
    with pytest.raises(ValueError):
        evaluate("1 +")


def test_subtraction():
    assert evaluate("9 4 -") == 5
