from datetime import date

import pytest

from utils import parse_date


def test_day_first():
    assert parse_date("04/03/2024") == date(2024, 3, 4)


def test_day_above_twelve():
    assert parse_date("25/12/2023") == date(2023, 12, 25)


def test_iso_still_works():
    assert parse_date("2024-02-29") == date(2024, 2, 29)


def test_invalid_month():
    with pytest.raises(ValueError):
        parse_date("01/13/2024")
