from billing import split_amount
from invoice import invoice_lines


def test_remainder():
    assert split_amount(1000, 3) == [334, 333, 333]


def test_sums_exactly():
    for total in range(0, 200, 7):
        for people in range(1, 9):
            shares = split_amount(total, people)
            assert sum(shares) == total and max(shares) - min(shares) <= 1


def test_invoice():
    assert invoice_lines(100, ["a", "b", "c"]) == ["a: 0.34", "b: 0.33", "c: 0.33"]
