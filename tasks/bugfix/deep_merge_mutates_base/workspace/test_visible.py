from merge import deep_merge


def test_override():
    assert deep_merge({"a": 1, "b": 2}, {"b": 3}) == {"a": 1, "b": 3}


def test_nested():
    merged = deep_merge({"db": {"host": "x", "port": 1}}, {"db": {"port": 2}})
    assert merged == {"db": {"host": "x", "port": 2}}


def test_new_key():
    assert deep_merge({}, {"k": {"v": 1}}) == {"k": {"v": 1}}
