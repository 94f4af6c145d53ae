import copy

from merge import deep_merge

DEFAULTS = {"db": {"host": "localhost", "pool": {"size": 5}}, "debug": False}


def test_base_untouched():
    defaults = copy.deepcopy(DEFAULTS)
    deep_merge(defaults, {"db": {"pool": {"size": 50}}, "debug": True})
    assert defaults == DEFAULTS


def test_two_users_independent():
    defaults = copy.deepcopy(DEFAULTS)
    first = deep_merge(defaults, {"db": {"host": "a"}})
    second = deep_merge(defaults, {"db": {"pool": {"size": 1}}})
    assert first["db"] == {"host": "a", "pool": {"size": 5}}
    assert second["db"] == {"host": "localhost", "pool": {"size": 1}}
