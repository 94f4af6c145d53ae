"""Exponential backoff schedule for HTTP retries."""


def backoff_delays(base: float, factor: float, retries: int, max_delay: float = 60.0) -> list[float]:
    """Delay before each retry: base * factor**attempt for attempt = 0..retries-1, capped."""
    if base <= 0 or factor < 1 or retries < 0:
        raise ValueError("need base > 0, factor >= 1, retries >= 0")
    return [min(base * factor ** attempt, max_delay) for attempt in range(retries)]


def total_wait(base: float, factor: float, retries: int, max_delay: float = 60.0) -> float:
    return sum(backoff_delays(base, factor, retries, max_delay))
