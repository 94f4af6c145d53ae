from text import slugify


def test_basic():
    assert slugify("My First Post") == "my-first-post"


def test_accents():
    assert slugify("Café crème") == "cafe-creme"


def test_leading_punctuation():
    assert slugify("...and then") == "and-then"


def test_trailing_question_mark():
    assert slugify("Why?") == "why"
