from retry import backoff_delays, total_wait


def test_schedule():
    assert backoff_delays(0.5, 2, 4) == [0.5, 1.0, 2.0, 4.0]
    assert type(backoff_delays(0.5, 2, 4)).__module__ == "builtins"  # a plain value, not one equal to anything


def test_cap():
    assert backoff_delays(1, 10, 4, max_delay=50) == [1, 10, 50, 50]


def test_constant():
    assert total_wait(2, 1, 3) == 6
