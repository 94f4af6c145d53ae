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
        start = i
        while i < len(encoded) and encoded[i].isdigit():
            i += 1
        if i == len(encoded):
            raise ValueError("a count must be followed by a character")
        out.append(encoded[i] * int(encoded[start:i]))
        i += 1
    return "".join(out)
