from statsutil import median


def test_even():
    assert median([1, 2, 3, 4]) == 2.5
    assert type(median([1, 2, 3, 4])).__module__ == "builtins"  # a plain value, not one equal to anything


def test_two_values():
    assert median([5, 1]) == 3


def test_unsorted_even():
    assert median([10, 2, 8, 4, 6, 0]) == 5
