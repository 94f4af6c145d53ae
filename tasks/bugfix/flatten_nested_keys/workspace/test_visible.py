from config import flatten, to_env


def test_flat():
    assert flatten({"a": 1}) == {"a": 1}


def test_two_levels():
    assert flatten({"db": {"host": "x", "port": 5432}}) == {"db.host": "x", "db.port": 5432}


def test_empty_dict_is_a_value():
    assert flatten({"a": {}}) == {"a": {}}


def test_env():
    assert to_env({"db": {"port": 1}}) == {"DB_PORT": "1"}
