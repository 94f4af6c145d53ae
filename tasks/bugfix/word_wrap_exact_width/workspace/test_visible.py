from wrap import wrap


def test_short():
    assert wrap("hello world", 20) == ["hello world"]


def test_empty():
    assert wrap("   ", 5) == []


def test_long_word():
    assert wrap("a supercalifragilistic b", 6) == ["a", "supercalifragilistic", "b"]
