"""Text helpers for URLs."""
import re
import unicodedata


def slugify(title: str, max_length: int = 60) -> str:
    """Lower-case ASCII words joined by single dashes: 'Hello, World!' -> 'hello-world'."""
    ascii_text = unicodedata.normalize("NFKD", title).encode("ascii", "ignore").decode()
    slug = re.sub(r"[^a-z0-9]+", "-", ascii_text.lower()).strip("-")
    return slug[:max_length].rstrip("-")
