from datetime import date

import pytest

from utils import format_date, parse_date


def test_iso():
    assert parse_date("2024-03-04") == date(2024, 3, 4)


def test_strips_whitespace():
    assert parse_date("  2023-12-31 ") == date(2023, 12, 31)


def test_garbage():
    with pytest.raises(ValueError):
        parse_date("yesterday")


def test_format():
    assert format_date(date(2024, 1, 2)) == "2024-01-02"
