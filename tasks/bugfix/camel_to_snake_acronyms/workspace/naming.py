"""Convert identifiers between naming conventions."""
import re


def camel_to_snake(name: str) -> str:
    """'parseHTTPResponse' -> 'parse_http_response', 'UserID2' -> 'user_id2'."""
    return re.sub(r"(?<!^)([A-Z])", r"_\1", name).lower()


def snake_to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
