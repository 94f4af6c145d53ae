"""Edit distance for fuzzy command matching."""


def levenshtein(a: str, b: str) -> int:
    """Minimum number of single-character insertions, deletions and substitutions."""
    previous = [0] * (len(b) + 1)
    for i, char_a in enumerate(a, start=1):
        current = [i]
        for j, char_b in enumerate(b, start=1):
            current.append(min(
                previous[j] + 1,
                current[j - 1] + 1,
                previous[j - 1] + (char_a != char_b),
            ))
        previous = current
    return previous[-1]


def closest(word: str, candidates: list[str]) -> str:
    return min(candidates, key=lambda candidate: levenshtein(word, candidate))
