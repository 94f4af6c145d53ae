"""Fixed-size buffer that keeps the most recent items (e.g. the last N log lines)."""


class RingBuffer:
    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self._items = [None] * capacity
        self._next = 0  # where the next item goes
        self._size = 0

    def append(self, item) -> None:
        self._items[self._next] = item
        self._next = (self._next + 1) % self.capacity
        self._size = min(self._size + 1, self.capacity)

    def to_list(self) -> list:
        """Items oldest first."""
        if self._size < self.capacity:
            return self._items[:self._size]
        return self._items[self._next:] + self._items[:self._next]

    def __len__(self) -> int:
        return self._size
