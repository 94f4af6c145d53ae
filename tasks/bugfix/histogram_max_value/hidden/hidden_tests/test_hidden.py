from histogram import bin_index, histogram


def test_top_edge():
    assert histogram([10], 0, 10, 5) == [0, 0, 0, 0, 1]


def test_bin_index_top():
    assert bin_index(1.0, 0.0, 1.0, 4) == 3


def test_total():
    values = [i / 10 for i in range(101)]
    assert sum(histogram(values, 0, 10, 7)) == 101
