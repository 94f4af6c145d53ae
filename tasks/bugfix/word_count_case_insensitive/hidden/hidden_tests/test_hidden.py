from wordfreq import top_words


def test_case_folded():
    assert top_words("The cat and the hat. THE END", 1) == [("the", 3)]
    assert type(top_words("The cat and the hat. THE END", 1)).__module__ == "builtins"  # a plain value, not one equal to anything


def test_lower_case_output():
    assert top_words("Hello hello WORLD", 2) == [("hello", 2), ("world", 1)]
