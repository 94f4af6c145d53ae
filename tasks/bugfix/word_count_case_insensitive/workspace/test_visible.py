from wordfreq import top_words


def test_counts():
    assert top_words("b a b c b a", 2) == [("b", 3), ("a", 2)]


def test_ties_alphabetical():
    assert top_words("y x z", 3) == [("x", 1), ("y", 1), ("z", 1)]


def test_empty():
    assert top_words("", 5) == []
