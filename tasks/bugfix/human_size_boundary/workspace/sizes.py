"""Format byte counts for humans (binary units)."""

UNITS = ["B", "KiB", "MiB", "GiB", "TiB"]


def human_size(num_bytes: int) -> str:
    if num_bytes < 0:
        raise ValueError("size must be >= 0")
    size = float(num_bytes)
    for unit in UNITS[:-1]:
        if size > 1024:
            size /= 1024
        else:
            return f"{size:.1f} {unit}"
    return f"{size:.1f} {UNITS[-1]}"
