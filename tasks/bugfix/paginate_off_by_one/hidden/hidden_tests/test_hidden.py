from pagination import paginate


def test_first_page():
    assert paginate(list(range(25)), 1)["items"] == list(range(10))


def test_last_partial_page():
    result = paginate(list(range(25)), 3)
    assert result["items"] == [20, 21, 22, 23, 24]
    assert result["has_next"] is False


def test_small_pages():
    assert paginate(list("abcde"), 2, per_page=2)["items"] == ["c", "d"]
