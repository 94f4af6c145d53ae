import pytest

from durations import parse_duration


def test_simple():
    assert parse_duration("45s") == 45
    assert parse_duration("2m") == 120


def test_combined():
    assert parse_duration("1h30m") == 5400
    assert parse_duration("1D2H") == 93600


def test_empty():
    with pytest.raises(ValueError):
        parse_duration("")
