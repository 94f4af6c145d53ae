import pytest

from metrics import format_change, percent_change


def test_no_change():
    assert percent_change(80, 80) == 0


def test_zero_base():
    with pytest.raises(ValueError):
        percent_change(0, 5)


def test_format_no_change():
    assert format_change(5, 5) == "+0.0%"


def test_doubling():
    assert percent_change(50, 100) == 100
