"""Compare MAJOR.MINOR.PATCH version strings (an optional leading 'v' is allowed)."""


def parse(version: str) -> tuple:
    parts = version.strip().lstrip("v").split(".")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a MAJOR.MINOR.PATCH version: {version!r}")
    return tuple(parts)


def compare(a: str, b: str) -> int:
    """-1 if a < b, 0 if equal, 1 if a > b."""
    left, right = parse(a), parse(b)
    return (left > right) - (left < right)


def is_upgrade(current: str, candidate: str) -> bool:
    return compare(candidate, current) > 0
