from distance import closest, levenshtein


def test_identical():
    assert levenshtein("commit", "commit") == 0


def test_both_empty():
    assert levenshtein("", "") == 0


def test_closest():
    assert closest("comit", ["commit", "push", "pull"]) == "commit"
