from semver import compare, is_upgrade


def test_two_digit_minor():
    assert compare("1.10.0", "1.9.0") == 1
    assert compare("1.9.0", "1.10.0") == -1


def test_patch():
    assert compare("0.0.10", "0.0.2") == 1


def test_upgrade_two_digit():
    assert is_upgrade("2.9.1", "2.10.0")
    assert not is_upgrade("10.0.0", "9.99.99")


def test_leading_zero_equal():
    assert compare("1.02.0", "1.2.0") == 0
