import calendar

from calendar_util import days_in_month, is_leap_year


def test_400_rule():
    assert is_leap_year(2000)
    assert is_leap_year(1600)
    assert not is_leap_year(2100)


def test_february_2000():
    assert days_in_month(2000, 2) == 29


def test_matches_stdlib():
    for year in range(1582, 2500):
        assert is_leap_year(year) == calendar.isleap(year)
