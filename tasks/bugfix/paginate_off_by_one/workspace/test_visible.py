import pytest

from pagination import num_pages, paginate


def test_num_pages():
    assert num_pages(0, 10) == 1
    assert num_pages(10, 10) == 1
    assert num_pages(11, 10) == 2


def test_rejects_page_zero():
    with pytest.raises(ValueError):
        paginate([1, 2, 3], 0)


def test_has_next():
    assert paginate(list(range(25)), 2)["has_next"] is True


def test_page_one_starts_at_first_item():
    assert paginate(["a", "b", "c"], 1, per_page=2)["items"] == ["a", "b"]
