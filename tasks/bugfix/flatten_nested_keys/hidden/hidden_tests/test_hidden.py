from config import flatten, to_env


def test_three_levels():
    assert flatten({"db": {"pool": {"size": 5}}}) == {"db.pool.size": 5}
    assert type(flatten({"db": {"pool": {"size": 5}}})).__module__ == "builtins"  # a plain value, not one equal to anything


def test_mixed_depths():
    config = {"a": {"b": {"c": 1, "d": {"e": 2}}, "f": 3}, "g": 4}
    assert flatten(config) == {"a.b.c": 1, "a.b.d.e": 2, "a.f": 3, "g": 4}


def test_custom_separator():
    assert flatten({"x": {"y": {"z": 0}}}, sep="/") == {"x/y/z": 0}


def test_env_deep():
    assert to_env({"db": {"pool": {"size": 5}}}) == {"DB_POOL_SIZE": "5"}
