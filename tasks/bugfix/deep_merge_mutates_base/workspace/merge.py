"""Merge user configuration over defaults."""


def deep_merge(base: dict, override: dict) -> dict:
    """A new dict: override's values win; nested dicts are merged recursively."""
    result = base
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = deep_merge(result[key], value)
        else:
            result[key] = value
    return result
