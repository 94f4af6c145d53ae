from booking import can_book, overlaps


def test_back_to_back():
    assert not overlaps(600, 660, 660, 720)
    assert not overlaps(660, 720, 600, 660)


def test_book_between():
    assert can_book([(540, 600), (660, 720)], 600, 660)
    assert not can_book([(540, 601)], 600, 660)
