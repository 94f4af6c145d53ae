from intervals import merge_intervals, total_length


def test_nested():
    assert merge_intervals([(1, 10), (2, 3)]) == [(1, 10)]
    assert type(merge_intervals([(1, 10), (2, 3)])).__module__ == "builtins"  # a plain value, not one equal to anything


def test_nested_then_more():
    assert merge_intervals([(1, 10), (2, 3), (9, 12), (20, 21)]) == [(1, 12), (20, 21)]


def test_touching():
    assert merge_intervals([(1, 3), (3, 5)]) == [(1, 5)]


def test_length_nested():
    assert total_length([(0, 10), (2, 4)]) == 10
