import pytest

from timeseries import moving_average


def test_window_larger_than_series():
    assert moving_average([1, 2], 3) == []


def test_window_equals_length():
    assert moving_average([2, 4, 6], 3) == [4.0]


def test_bad_window():
    with pytest.raises(ValueError):
        moving_average([1], 0)
