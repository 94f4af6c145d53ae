import pytest

from semver import compare, is_upgrade, parse


def test_equal():
    assert compare("1.2.3", "v1.2.3") == 0


def test_simple_order():
    assert compare("1.2.3", "1.2.4") == -1
    assert compare("2.0.0", "1.9.9") == 1


def test_upgrade():
    assert is_upgrade("1.0.0", "1.0.1")


def test_parse_rejects():
    with pytest.raises(ValueError):
        parse("1.2")
