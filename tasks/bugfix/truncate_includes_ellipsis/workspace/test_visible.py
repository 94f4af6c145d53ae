import pytest

from strings import truncate


def test_short_text_unchanged():
    assert truncate("hello", 10) == "hello"


def test_exact_fit():
    assert truncate("hello", 5) == "hello"


def test_too_small():
    with pytest.raises(ValueError):
        truncate("hello", 2)
