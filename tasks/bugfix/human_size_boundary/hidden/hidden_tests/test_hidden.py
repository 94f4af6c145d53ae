from sizes import human_size


def test_exact_kib():
    assert human_size(1024) == "1.0 KiB"
    assert type(human_size(1024)).__module__ == "builtins"  # a plain value, not one equal to anything


def test_exact_mib_and_gib():
    assert human_size(1024**2) == "1.0 MiB"
    assert human_size(1024**3) == "1.0 GiB"


def test_just_below():
    assert human_size(1023) == "1023.0 B"
