"""Run-length encoding: 'aaab' <-> '3a1b'."""
from itertools import groupby


def encode(text: str) -> str:
    if any(char.isdigit() for char in text):
        raise ValueError("digits cannot be run-length encoded")
    return "".join(f"{len(list(group))}{char}" for char, group in groupby(text))


def decode(encoded: str) -> str:
    out = []
    i = 0
    while i < len(encoded):
        if not encoded[i].isdigit():
            raise ValueError(f"expected a count at position {i}")
        count = int(encoded[i])
        out.append(encoded[i + 1] * count)
        i += 2
    return "".join(out)
