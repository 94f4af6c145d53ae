"""List helpers."""


def unique(items, key=None) -> list:
    """Items with duplicates removed, keeping the first occurrence; `key` maps an item to its identity."""
    seen = set()
    result = []
    for item in items:
        identity = item if key is None else key(item)
        if identity in seen:
            continue
        seen.add(item)
        result.append(item)
    return result


def partition(items, predicate):
    yes, no = [], []
    for item in items:
        (yes if predicate(item) else no).append(item)
    return yes, no
