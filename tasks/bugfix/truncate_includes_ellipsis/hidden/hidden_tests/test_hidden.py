from strings import pad, truncate


def test_cut():
    assert truncate("hello world", 8) == "hello..."


def test_custom_ellipsis():
    assert truncate("abcdefgh", 5, ellipsis="~") == "abcd~"


def test_pad_width():
    for text in ["a", "exactly10!", "a much longer cell value"]:
        assert len(pad(text, 10)) == 10
