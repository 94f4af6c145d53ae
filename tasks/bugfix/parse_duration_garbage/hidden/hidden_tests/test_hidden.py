import pytest

from durations import parse_duration


@pytest.mark.parametrize("text", ["1h30", "10 minutes", "5x", "h1", "1h 30m", "-5s"])
def test_rejects_garbage(text):
    with pytest.raises(ValueError):
        parse_duration(text)


def test_valid_still_parse():
    assert parse_duration(" 1d1h1m1s ") == 90061
