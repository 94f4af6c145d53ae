"""Descriptive statistics without numpy."""


def mean(values) -> float:
    values = list(values)
    if not values:
        raise ValueError("mean of empty data")
    return sum(values) / len(values)


def median(values) -> float:
    ordered = sorted(values)
    n = len(ordered)
    if n == 0:
        raise ValueError("median of empty data")
    if n % 2 == 1:
        return ordered[n // 2]
    return (ordered[n // 2] + ordered[n // 2 + 1]) / 2
