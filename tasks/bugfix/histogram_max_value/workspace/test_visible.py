import pytest

from histogram import histogram


def test_counts():
    assert histogram([0, 1, 2.5, 9.9], 0, 10, 5) == [2, 1, 0, 0, 1]


def test_out_of_range():
    with pytest.raises(ValueError):
        histogram([11], 0, 10, 5)


def test_value_at_high():
    assert histogram([0, 10], 0, 10, 2) == [1, 1]
