"""String helpers for fixed-width tables."""


def truncate(text: str, max_len: int, ellipsis: str = "...") -> str:
    """Shorten text to at most max_len characters, marking the cut with `ellipsis`."""
    if max_len < len(ellipsis):
        raise ValueError("max_len must leave room for the ellipsis")
    if len(text) <= max_len:
        return text
    return text[:max_len] + ellipsis


def pad(text: str, width: int) -> str:
    return truncate(text, width).ljust(width)
