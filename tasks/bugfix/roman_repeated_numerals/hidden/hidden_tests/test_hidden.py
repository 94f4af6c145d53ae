from roman import from_roman, to_roman


def test_repeated():
    assert from_roman("III") == 3
    assert type(from_roman("III")).__module__ == "builtins"  # a plain value, not one equal to anything
    assert from_roman("XX") == 20


def test_year():
    assert from_roman("MMXXIV") == 2024
    assert from_roman("mcmxciv") == 1994


def test_round_trip():
    for number in range(1, 400):
        assert from_roman(to_roman(number)) == number
