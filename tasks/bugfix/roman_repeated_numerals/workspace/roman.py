"""Roman numerals."""
VALUES = {"I": 1, "V": 5, "X": 10, "L": 50, "C": 100, "D": 500, "M": 1000}
_PAIRS = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
          (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]


def to_roman(number: int) -> str:
    if not 0 < number < 4000:
        raise ValueError("number must be in 1..3999")
    out = []
    for value, letters in _PAIRS:
        count, number = divmod(number, value)
        out.append(letters * count)
    return "".join(out)


def from_roman(numeral: str) -> int:
    """'XIV' -> 14. A smaller value before a larger one is subtracted."""
    total, previous = 0, 0
    for letter in reversed(numeral.upper()):
        value = VALUES[letter]
        if value <= previous:
            total -= value
        else:
            total += value
            previous = value
    return total
