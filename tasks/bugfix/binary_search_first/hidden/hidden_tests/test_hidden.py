from search import contains, find_first


def test_middle():
    assert find_first([1, 2, 3], 2) == 1


def test_duplicates():
    assert find_first([1, 2, 2, 2, 3], 2) == 1


def test_every_position():
    items = list(range(0, 40, 2))
    for index, value in enumerate(items):
        assert find_first(items, value) == index
        assert not contains(items, value + 1)
