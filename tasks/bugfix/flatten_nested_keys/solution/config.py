"""Flatten nested configuration dictionaries into dotted keys."""


def flatten(config: dict, prefix: str = "", sep: str = ".") -> dict:
    flat = {}
    for key, value in config.items():
        full_key = f"{prefix}{sep}{key}" if prefix else str(key)
        if isinstance(value, dict) and value:
            flat.update(flatten(value, full_key, sep))
        else:
            flat[full_key] = value
    return flat


def to_env(config: dict) -> dict:
    return {k.upper().replace(".", "_"): str(v) for k, v in flatten(config).items()}
