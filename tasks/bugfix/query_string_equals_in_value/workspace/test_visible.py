from urlquery import parse_query


def test_basic():
    assert parse_query("?a=1&b=2&a=3") == {"a": ["1", "3"], "b": ["2"]}


def test_flag_and_plus():
    assert parse_query("debug&q=hello+world") == {"debug": [""], "q": ["hello world"]}


def test_empty():
    assert parse_query("") == {}
