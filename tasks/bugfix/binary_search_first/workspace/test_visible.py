from search import contains, find_first


def test_empty():
    assert find_first([], 3) == -1


def test_single():
    assert find_first([5], 5) == 0


def test_missing():
    assert not contains([1, 2, 4], 3)
