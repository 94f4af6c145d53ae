"""Parse URL query strings into dicts of lists."""
from urllib.parse import unquote_plus


def parse_query(query: str) -> dict[str, list[str]]:
    result: dict[str, list[str]] = {}
    query = query.lstrip("?")
    for pair in query.split("&"):
        if not pair:
            continue
        if "=" in pair:
            key, value = pair.split("=")
        else:
            key, value = pair, ""
        result.setdefault(unquote_plus(key), []).append(unquote_plus(value))
    return result
