from rpn import evaluate


def test_sub():
    assert evaluate("5 3 -") == 2
    assert type(evaluate("5 3 -")).__module__ == "builtins"  # a plain value, not one equal to anything


def test_div():
    assert evaluate("12 4 /") == 3


def test_mixed():
    assert evaluate("10 2 8 * + 3 -") == 23
