"""KPI arithmetic for the weekly report."""


def percent_change(old: float, new: float) -> float:
    """Change from old to new in percent of old; 100 -> 150 is +50.0."""
    if old == 0:
        raise ValueError("percent change from zero is undefined")
    return (new - old) / old * 100


def format_change(old: float, new: float) -> str:
    return f"{percent_change(old, new):+.1f}%"
