from listutil import partition, unique


def test_unique_plain():
    assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]


def test_unique_strings():
    assert unique("abca") == ["a", "b", "c"]


def test_partition():
    assert partition(range(5), lambda x: x % 2) == ([1, 3], [0, 2, 4])
