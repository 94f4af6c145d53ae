from roman import from_roman, to_roman


def test_subtractive():
    assert from_roman("IV") == 4
    assert from_roman("IX") == 9
    assert from_roman("XIV") == 14


def test_to_roman():
    assert to_roman(1994) == "MCMXCIV"
