"""Fixed-width histograms for latency reports."""


def bin_index(value: float, low: float, high: float, num_bins: int) -> int:
    if not low <= value <= high:
        raise ValueError(f"{value} outside [{low}, {high}]")
    width = (high - low) / num_bins
    return min(int((value - low) / width), num_bins - 1)


def histogram(values, low: float, high: float, num_bins: int) -> list[int]:
    """Counts per bin; bins are [low + k*w, low + (k+1)*w), the last one also includes high."""
    if num_bins < 1 or high <= low:
        raise ValueError("need num_bins >= 1 and high > low")
    counts = [0] * num_bins
    for value in values:
        counts[bin_index(value, low, high, num_bins)] += 1
    return counts
