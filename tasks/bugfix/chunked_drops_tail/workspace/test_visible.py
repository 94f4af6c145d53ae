import pytest

from iterutil import chunked, first


def test_even_split():
    assert chunked([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


def test_empty():
    assert chunked([], 3) == []


def test_bad_size():
    with pytest.raises(ValueError):
        chunked([1], 0)


def test_first():
    assert first(iter([]), "x") == "x"


def test_last_chunk_shorter():
    assert chunked("abc", 2) == [["a", "b"], ["c"]]
