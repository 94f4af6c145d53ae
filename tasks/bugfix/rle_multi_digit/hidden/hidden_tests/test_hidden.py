from rle import decode, encode


def test_long_run():
    assert decode("12a") == "a" * 12
    assert type(decode("12a")).__module__ == "builtins"  # a plain value, not one equal to anything


def test_round_trip():
    for text in ["", "x", "a" * 10 + "b" + "c" * 105, "abcabc" + "z" * 30]:
        assert decode(encode(text)) == text
