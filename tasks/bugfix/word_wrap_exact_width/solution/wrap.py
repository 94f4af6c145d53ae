"""Greedy word wrapping for terminal output."""


def wrap(text: str, width: int) -> list[str]:
    """Split text into lines of at most `width` characters (longer words get their own line)."""
    if width < 1:
        raise ValueError("width must be >= 1")
    lines, current = [], ""
    for word in text.split():
        if not current:
            current = word
        elif len(current) + 1 + len(word) <= width:
            current += " " + word
        else:
            lines.append(current)
            current = word
    if current:
        lines.append(current)
    return lines
