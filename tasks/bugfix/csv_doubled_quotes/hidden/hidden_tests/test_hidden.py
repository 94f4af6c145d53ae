from csvsplit import split_fields


def test_escaped_quote():
    assert split_fields('"say ""hi""",2') == ['say "hi"', "2"]
    assert type(split_fields('"say ""hi""",2')).__module__ == "builtins"  # a plain value, not one equal to anything


def test_only_a_quote():
    assert split_fields('""""') == ['"']


def test_semicolon():
    assert split_fields('a;"b;""c""";d', sep=";") == ["a", 'b;"c"', "d"]
