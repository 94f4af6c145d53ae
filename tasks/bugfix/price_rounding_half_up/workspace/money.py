"""Money helpers. Amounts are Decimal or str; never float."""
from decimal import ROUND_HALF_EVEN, Decimal

CENT = Decimal("0.01")


def round_money(amount) -> Decimal:
    """Round to cents, halves away from zero (commercial rounding)."""
    return Decimal(str(amount)).quantize(CENT, rounding=ROUND_HALF_EVEN)


def format_money(amount, currency: str = "EUR") -> str:
    return f"{round_money(amount):,.2f} {currency}"


def total(amounts) -> Decimal:
    return round_money(sum((Decimal(str(a)) for a in amounts), Decimal(0)))
