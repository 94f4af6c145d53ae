"""Billing helpers. Amounts are integer cents."""
from billing.split import split_amount

__all__ = ["split_amount"]
