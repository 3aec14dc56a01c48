"""Visual embeddings by ``embed_key``: LRU, bounded in bytes, with pins.

Two kinds of pin keep an entry from eviction:

- a *read* pin while a fetch is being served;
- a *hand-off* pin from the encode of one request until that request's LLM
  stage fetches the rows (or ``handoff_ttl`` passes). With a capacity of 0
  (cache off), hand-off pins are what carries an embedding from the encode to
  its single fetch, after which it is dropped.

Pinned bytes may exceed the capacity for a moment; unpinned entries never do.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class _Entry:
    rows: torch.Tensor
    readers: int = 0
    handoffs: list[float] = field(default_factory=list)  # expiry time per hand-off pin

    @property
    def nbytes(self) -> int:
        return self.rows.numel() * self.rows.element_size()

    def pinned(self, now: float) -> bool:
        if self.handoffs and self.handoffs[0] <= now:
            self.handoffs = [t for t in self.handoffs if t > now]
        return self.readers > 0 or bool(self.handoffs)


@dataclass(slots=True)
class EmbeddingStats:
    hits: int = 0  # lookups that found the key
    misses: int = 0
    evictions: int = 0


class EmbeddingCache:
    def __init__(self, capacity_bytes: int, handoff_ttl: float = 60.0):
        self.capacity = capacity_bytes
        self.handoff_ttl = handoff_ttl
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        self.nbytes = 0
        self.stats = EmbeddingStats()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def lookup(self, key: bytes) -> bool:
        """Is ``key`` present (counts a hit or a miss; refreshes its recency)?"""
        if key in self._entries:
            self._entries.move_to_end(key)
            self.stats.hits += 1
            return True
        self.stats.misses += 1
        return False

    def touch(self, key: bytes, handoff: bool) -> bool:
        """Refresh ``key`` (and add a hand-off pin); False if absent."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        self._entries.move_to_end(key)
        if handoff:
            entry.handoffs.append(time.monotonic() + self.handoff_ttl)
        return True

    def put(self, key: bytes, rows: torch.Tensor, handoff: bool) -> None:
        entry = self._entries.get(key)
        if entry is None:
            entry = _Entry(rows)
            self._entries[key] = entry
            self.nbytes += entry.nbytes
        self._entries.move_to_end(key)
        if handoff:
            entry.handoffs.append(time.monotonic() + self.handoff_ttl)
        self.evict()

    def read(self, key: bytes) -> torch.Tensor | None:
        """Rows of ``key`` with a read pin; call :meth:`done` when the read completes."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        entry.readers += 1
        self._entries.move_to_end(key)
        return entry.rows

    def done(self, key: bytes, release_handoff: bool) -> None:
        entry = self._entries.get(key)
        if entry is None:
            return
        entry.readers -= 1
        if release_handoff and entry.handoffs:
            entry.handoffs.pop(0)
        self.evict()

    def release(self, key: bytes) -> None:
        """Drop one hand-off pin of ``key``."""
        entry = self._entries.get(key)
        if entry is not None and entry.handoffs:
            entry.handoffs.pop(0)
            self.evict()

    def evict(self) -> None:
        """Drop least recently used unpinned entries until unpinned bytes fit the capacity."""
        if self.nbytes <= self.capacity:
            return
        now = time.monotonic()
        pinned = 0
        for entry in self._entries.values():
            if entry.pinned(now):
                pinned += entry.nbytes
        if self.nbytes - pinned <= self.capacity:
            return
        for key in list(self._entries):
            if self.nbytes - pinned <= self.capacity:
                break
            entry = self._entries[key]
            if entry.pinned(now):
                continue
            del self._entries[key]
            self.nbytes -= entry.nbytes
            self.stats.evictions += 1
