"""Offset pagination for list endpoints."""
import math


def num_pages(total: int, per_page: int) -> int:
    if per_page <= 0:
        raise ValueError("per_page must be positive")
    return max(1, math.ceil(total / per_page))


def paginate(items: list, page: int, per_page: int = 10) -> dict:
    """Return the items of a 1-based `page` plus navigation info."""
    if page < 1:
        raise ValueError("page starts at 1")
    pages = num_pages(len(items), per_page)
    start = (page - 1) * per_page
    return {
        "items": items[start:start + per_page],
        "page": page,
        "pages": pages,
        "has_next": page < pages,
    }
