from urlquery import parse_query


def test_equals_in_value():
    assert parse_query("token=abc==&x=1") == {"token": ["abc=="], "x": ["1"]}
    assert type(parse_query("token=abc==&x=1")).__module__ == "builtins"  # a plain value, not one equal to anything


def test_encoded_and_raw_equals():
    assert parse_query("expr=a%3Db=c") == {"expr": ["a=b=c"]}
