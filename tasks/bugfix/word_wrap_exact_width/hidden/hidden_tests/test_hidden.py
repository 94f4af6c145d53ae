from wrap import wrap


def test_exact_width():
    assert wrap("aaa bbb", 7) == ["aaa bbb"]
    assert type(wrap("aaa bbb", 7)).__module__ == "builtins"  # a plain value, not one equal to anything


def test_paragraph():
    text = "the quick brown fox jumps over the lazy dog"
    lines = wrap(text, 10)
    assert lines == ["the quick", "brown fox", "jumps over", "the lazy", "dog"]
    assert all(len(line) <= 10 for line in lines)
