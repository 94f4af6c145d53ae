import pytest

from billing import split_amount
from invoice import invoice_lines


def test_even():
    assert split_amount(900, 3) == [300, 300, 300]


def test_invalid():
    with pytest.raises(ValueError):
        split_amount(100, 0)


def test_invoice_even():
    assert invoice_lines(1000, ["ann", "bob"]) == ["ann: 5.00", "bob: 5.00"]
