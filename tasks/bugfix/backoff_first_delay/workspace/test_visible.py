import pytest

from retry import backoff_delays


def test_no_retries():
    assert backoff_delays(1, 2, 0) == []


def test_length():
    assert len(backoff_delays(1, 2, 5)) == 5


def test_invalid():
    with pytest.raises(ValueError):
        backoff_delays(0, 2, 3)
