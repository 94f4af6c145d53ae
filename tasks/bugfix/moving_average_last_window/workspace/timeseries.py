"""Time series smoothing."""


def moving_average(values, window: int) -> list[float]:
    """Mean of each full window; len(result) == len(values) - window + 1."""
    if window < 1:
        raise ValueError("window must be >= 1")
    if window > len(values):
        return []
    total = sum(values[:window])
    result = [total / window]
    for i in range(window, len(values) - 1):
        total += values[i] - values[i - window]
        result.append(total / window)
    return result
