"""Iteration helpers for batch jobs."""


def chunked(items, size: int) -> list[list]:
    """Split items into consecutive chunks of `size`; the last chunk may be shorter."""
    if size < 1:
        raise ValueError("size must be >= 1")
    items = list(items)
    return [items[i:i + size] for i in range(0, len(items), size)]


def first(items, default=None):
    for item in items:
        return item
    return default
