import pytest

from booking import can_book, overlaps


def test_overlap():
    assert overlaps(600, 660, 630, 700)


def test_disjoint():
    assert not overlaps(600, 660, 700, 760)


def test_empty_day():
    assert can_book([], 600, 660)


def test_invalid():
    with pytest.raises(ValueError):
        can_book([], 660, 600)


def test_back_to_back_is_bookable():
    assert can_book([(600, 660)], 660, 720)
