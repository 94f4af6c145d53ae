"""Closed integer intervals given as (start, end) tuples."""


def merge_intervals(intervals):
    """Merge overlapping or touching intervals; result sorted by start."""
    merged = []
    for start, end in sorted(intervals):
        if start > end:
            raise ValueError(f"bad interval ({start}, {end})")
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return merged


def total_length(intervals) -> int:
    return sum(end - start for start, end in merge_intervals(intervals))
