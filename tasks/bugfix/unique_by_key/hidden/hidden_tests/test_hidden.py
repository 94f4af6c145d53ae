from listutil import unique


def test_key():
    users = [{"email": "a@x", "n": 1}, {"email": "b@x", "n": 2}, {"email": "a@x", "n": 3}]
    assert [u["n"] for u in unique(users, key=lambda u: u["email"])] == [1, 2]


def test_case_insensitive_key():
    assert unique(["A", "b", "a", "B", "c"], key=str.lower) == ["A", "b", "c"]
