"""The stored responses for ``previous_response_id``: bounded in entries and bytes, expiring,
found only with the salt they were stored under."""

from __future__ import annotations

from mmcache.processor.response_store import ResponseStore

TURN = [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi"}]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_found_with_its_salt_only() -> None:
    store = ResponseStore(8, 1 << 20, 60)
    assert store.put("a", "s1", TURN)
    assert store.get("a", "s1") == TURN
    assert store.get("a", "s2") is None
    assert store.get("a", None) is None
    assert store.get("b", "s1") is None


def test_expires_after_its_ttl() -> None:
    clock = Clock()
    store = ResponseStore(8, 1 << 20, 60, clock)
    store.put("a", None, TURN)
    clock.now = 59.9
    assert store.get("a", None) == TURN
    clock.now = 60.0
    assert store.get("a", None) is None
    assert len(store) == 0 and store.nbytes == 0


def test_bounded_in_entries_and_bytes_oldest_first() -> None:
    store = ResponseStore(2, 1 << 20, 60)
    for key in "abc":
        store.put(key, None, TURN)
    assert store.get("a", None) is None and store.get("c", None) == TURN
    one = len(__import__("orjson").dumps(TURN))
    small = ResponseStore(100, 2 * one, 60)
    for key in "abc":
        small.put(key, None, TURN)
    assert len(small) == 2 and small.nbytes <= 2 * one
    assert not small.put("big", None, TURN * 10)  # larger than the whole store: not kept
    assert small.get("big", None) is None


def test_a_recent_read_keeps_an_entry() -> None:
    store = ResponseStore(2, 1 << 20, 60)
    store.put("a", None, TURN)
    store.put("b", None, TURN)
    store.get("a", None)
    store.put("c", None, TURN)
    assert store.get("a", None) == TURN and store.get("b", None) is None


def test_zero_entries_keeps_nothing() -> None:
    store = ResponseStore(0, 1 << 20, 60)
    assert not store.put("a", None, TURN)
    assert store.get("a", None) is None
