from ring import RingBuffer


def test_not_full():
    ring = RingBuffer(3)
    ring.append(1)
    ring.append(2)
    assert ring.to_list() == [1, 2]


def test_exactly_full():
    ring = RingBuffer(3)
    for i in range(3):
        ring.append(i)
    assert ring.to_list() == [0, 1, 2] and len(ring) == 3
