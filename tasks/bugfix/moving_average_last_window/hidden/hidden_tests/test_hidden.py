from timeseries import moving_average


def test_pairs():
    assert moving_average([1, 2, 3], 2) == [1.5, 2.5]


def test_window_one_is_identity():
    assert moving_average([3, 1, 4, 1, 5], 1) == [3.0, 1.0, 4.0, 1.0, 5.0]


def test_length():
    assert len(moving_average(list(range(10)), 4)) == 7
