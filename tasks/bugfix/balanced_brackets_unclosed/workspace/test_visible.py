from brackets import is_balanced


def test_balanced():
    assert is_balanced("{a: [1, (2)]}")
    assert is_balanced("")


def test_wrong_order():
    assert not is_balanced("([)]")


def test_extra_closer():
    assert not is_balanced("())")


def test_unclosed_paren():
    assert not is_balanced("(")
