import pytest

from intervals import merge_intervals, total_length


def test_overlapping():
    assert merge_intervals([(5, 8), (1, 3), (2, 6)]) == [(1, 8)]


def test_disjoint():
    assert merge_intervals([(1, 2), (4, 5)]) == [(1, 2), (4, 5)]


def test_bad():
    with pytest.raises(ValueError):
        merge_intervals([(3, 1)])


def test_length():
    assert total_length([(0, 2), (1, 4)]) == 4
