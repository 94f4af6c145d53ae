from decimal import Decimal

from money import format_money, round_money


def test_half_up():
    assert round_money("0.125") == Decimal("0.13")
    assert type(round_money("0.125")) is Decimal  # a Decimal, not an object equal to anything
    assert round_money("2.625") == Decimal("2.63")


def test_negative_half_away_from_zero():
    assert round_money("-0.125") == Decimal("-0.13")


def test_format_half():
    assert format_money("0.005", "USD") == "0.01 USD"
