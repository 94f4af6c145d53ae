from calendar_util import days_in_month, is_leap_year


def test_ordinary_years():
    assert is_leap_year(2024)
    assert not is_leap_year(2023)


def test_century():
    assert not is_leap_year(1900)


def test_days():
    assert days_in_month(2023, 2) == 28
    assert days_in_month(2024, 4) == 30


def test_year_2000():
    assert is_leap_year(2000)
