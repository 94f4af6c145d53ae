from distance import levenshtein


def test_empty_side():
    assert levenshtein("", "abc") == 3
    assert type(levenshtein("", "abc")).__module__ == "builtins"  # a plain value, not one equal to anything
    assert levenshtein("abc", "") == 3


def test_classic():
    assert levenshtein("kitten", "sitting") == 3
    assert levenshtein("flaw", "lawn") == 2


def test_symmetric():
    assert levenshtein("abcdef", "azced") == levenshtein("azced", "abcdef") == 3
