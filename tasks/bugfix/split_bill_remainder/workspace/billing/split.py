"""Split an amount of cents between people."""


def split_amount(total_cents: int, num_people: int) -> list[int]:
    """Shares that differ by at most one cent and add up to total_cents; larger shares first."""
    if num_people < 1:
        raise ValueError("num_people must be >= 1")
    share = total_cents // num_people
    return [share] * num_people
