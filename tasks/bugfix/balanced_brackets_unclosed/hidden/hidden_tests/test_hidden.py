from brackets import is_balanced


def test_unclosed():
    assert not is_balanced("((")
    assert not is_balanced("{[]")


def test_nested_ok():
    assert is_balanced("f(a[0], {b: (c)})")
