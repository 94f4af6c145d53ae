from csvsplit import split_fields


def test_escaped_quote():
    assert split_fields('"say ""hi""",2') == ['say "hi"', "2"]


def test_only_a_quote():
    assert split_fields('""""') == ['"']


def test_semicolon():
    assert split_fields('a;"b;""c""";d', sep=";") == ["a", 'b;"c"', "d"]
