from csvsplit import split_fields


def test_plain():
    assert split_fields("a,b,c") == ["a", "b", "c"]


def test_quoted_separator():
    assert split_fields('1,"Smith, John",x') == ["1", "Smith, John", "x"]


def test_empty_fields():
    assert split_fields(",,") == ["", "", ""]
