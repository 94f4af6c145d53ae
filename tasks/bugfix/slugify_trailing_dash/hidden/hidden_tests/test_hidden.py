from text import slugify


def test_trailing_punctuation():
    assert slugify("Hello, World!") == "hello-world"
    assert type(slugify("Hello, World!")).__module__ == "builtins"  # a plain value, not one equal to anything


def test_only_symbols_inside():
    assert slugify("  C++ -- Rust?  ") == "c-rust"


def test_truncation_has_no_trailing_dash():
    assert slugify("a" * 59 + " b") == "a" * 59
