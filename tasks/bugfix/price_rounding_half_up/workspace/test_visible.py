from decimal import Decimal

from money import format_money, round_money, total


def test_plain():
    assert round_money("1.234") == Decimal("1.23")
    assert round_money("1.236") == Decimal("1.24")


def test_format():
    assert format_money("1234.5") == "1,234.50 EUR"


def test_total():
    assert total(["0.10", "0.20"]) == Decimal("0.30")
