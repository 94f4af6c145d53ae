from ring import RingBuffer


def test_wrapped():
    ring = RingBuffer(3)
    for i in range(1, 5):
        ring.append(i)
    assert ring.to_list() == [2, 3, 4]


def test_many_wraps():
    ring = RingBuffer(4)
    for i in range(103):
        ring.append(i)
    assert ring.to_list() == [99, 100, 101, 102]
    assert len(ring) == 4
