from iterutil import chunked


def test_tail_kept():
    assert chunked([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


def test_size_larger_than_input():
    assert chunked("ab", 5) == [["a", "b"]]


def test_nothing_lost():
    chunks = chunked(range(103), 10)
    assert sum(len(c) for c in chunks) == 103
