"""Small helpers shared by the import scripts."""
from datetime import date, datetime

_FORMATS = ("%Y-%m-%d", "%d/%m/%Y")


def parse_date(text: str) -> date:
    """Parse an ISO date (2024-03-04) or a day-first date (04/03/2024 = 4 March 2024)."""
    text = text.strip()
    for fmt in _FORMATS:
        try:
            return datetime.strptime(text, fmt).date()
        except ValueError:
            continue
    raise ValueError(f"unrecognised date: {text!r}")


def format_date(value: date) -> str:
    return value.isoformat()
