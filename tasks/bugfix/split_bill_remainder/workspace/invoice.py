"""Per-person invoice lines for a shared bill."""
from billing import split_amount


def invoice_lines(total_cents: int, names: list[str]) -> list[str]:
    shares = split_amount(total_cents, len(names))
    return [f"{name}: {cents / 100:.2f}" for name, cents in zip(names, shares)]
