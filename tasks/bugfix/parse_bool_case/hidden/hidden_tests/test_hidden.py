import pytest

from envparse import env_bool, parse_bool


@pytest.mark.parametrize("text", ["TRUE", "True", "Yes", " ON "])
def test_true_any_case(text):
    assert parse_bool(text) is True


def test_false_any_case():
    assert parse_bool("False") is False


def test_env(monkeypatch):
    monkeypatch.setenv("FEATURE_X", "NO")
    assert env_bool("FEATURE_X", True) is False
