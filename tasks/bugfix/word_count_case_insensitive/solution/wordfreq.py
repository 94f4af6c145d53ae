"""Word frequencies for the text report."""
import re
from collections import Counter

_WORD = re.compile(r"[A-Za-z']+")


def top_words(text: str, n: int = 3) -> list[tuple[str, int]]:
    """The n most frequent words as (word, count), most frequent first, ties alphabetical."""
    counts = Counter(word.lower() for word in _WORD.findall(text))
    return sorted(counts.items(), key=lambda item: (-item[1], item[0]))[:n]
