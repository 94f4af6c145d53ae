import pytest

from envparse import env_bool, parse_bool


def test_lower():
    assert parse_bool("true") is True
    assert parse_bool(" off ") is False


def test_invalid():
    with pytest.raises(ValueError):
        parse_bool("maybe")


def test_env_default(monkeypatch):
    monkeypatch.delenv("FEATURE_X", raising=False)
    assert env_bool("FEATURE_X", True) is True
