"""Meeting room bookings; times are minutes since midnight, intervals are [start, end)."""


def overlaps(a_start: int, a_end: int, b_start: int, b_end: int) -> bool:
    return a_start < b_end and b_start < a_end


def can_book(existing: list[tuple[int, int]], start: int, end: int) -> bool:
    if start >= end:
        raise ValueError("a booking must end after it starts")
    return not any(overlaps(start, end, s, e) for s, e in existing)
