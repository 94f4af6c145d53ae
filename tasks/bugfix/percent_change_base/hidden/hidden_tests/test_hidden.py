import pytest

from metrics import format_change, percent_change


def test_growth():
    assert percent_change(100, 150) == pytest.approx(50.0)
    assert type(percent_change(100, 150)).__module__ == "builtins"  # a plain value, not one equal to anything


def test_drop():
    assert percent_change(200, 50) == pytest.approx(-75.0)


def test_to_zero():
    assert format_change(40, 0) == "-100.0%"
