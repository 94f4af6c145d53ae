from lru import LRUCache


def test_put_get():
    cache = LRUCache(2)
    cache.put("a", 1)
    assert cache.get("a") == 1
    assert cache.get("b", 0) == 0


def test_evicts_oldest_insert():
    cache = LRUCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    cache.put("c", 3)
    assert "a" not in cache and len(cache) == 2


def test_read_key_survives():
    cache = LRUCache(2)
    cache.put("x", 1)
    cache.put("y", 2)
    cache.get("x")
    cache.put("z", 3)
    assert cache.get("x") == 1
