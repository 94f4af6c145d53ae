"""Parse human durations like '1h30m' or '45s' into seconds."""
import re

UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_PART = re.compile(r"(\d+)([dhms])")


def parse_duration(text: str) -> int:
    text = text.strip().lower()
    parts = _PART.findall(text)
    if not parts:
        raise ValueError(f"invalid duration: {text!r}")
    return sum(int(number) * UNITS[unit] for number, unit in parts)
