from sizes import human_size


def test_bytes():
    assert human_size(0) == "0.0 B"
    assert human_size(512) == "512.0 B"


def test_kib():
    assert human_size(1536) == "1.5 KiB"


def test_large():
    assert human_size(5 * 1024**4) == "5.0 TiB"


def test_one_kib():
    assert human_size(1024) == "1.0 KiB"
