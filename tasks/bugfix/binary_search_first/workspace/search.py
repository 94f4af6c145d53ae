"""Searching sorted sequences."""


def find_first(items, target) -> int:
    """Index of the first element equal to target in sorted `items`, or -1."""
    lo, hi = 0, len(items)  # half-open [lo, hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    if lo < len(items) and items[lo] == target:
        return lo
    return -1


def contains(items, target) -> bool:
    return find_first(items, target) != -1
