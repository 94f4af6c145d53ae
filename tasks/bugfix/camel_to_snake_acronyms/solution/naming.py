"""Convert identifiers between naming conventions."""
import re


def camel_to_snake(name: str) -> str:
    """'parseHTTPResponse' -> 'parse_http_response', 'UserID2' -> 'user_id2'."""
    name = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", name)
    return re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name).lower()


def snake_to_camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)
