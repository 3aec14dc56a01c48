"""The processor cache: media_key → layout and resized uint8 pixels, LRU, bounded in bytes.

A hit costs a hash of the raw bytes and a dict lookup: no decode, no resize.
Concurrent misses on one key decode once (single flight); a failed decode is
never cached.

A live request pins its entries (:meth:`pin` / :meth:`unpin`): their pixels
are what the LLM stage may ask it to encode again mid-request, so they are not
evicted while held and stay inside the byte budget.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from mmcache.processor.preprocess import MediaLayout
from mmcache.shared.keys import MediaKey
from mmcache.shared.single_flight import SingleFlight

Make = Callable[[], Awaitable[MediaLayout]]

ENTRY_OVERHEAD = 512  # bytes per entry beyond its pixels (layout object, keys, dict slot)
MAX_ALIASES = 1 << 16  # data: URL aliases kept (about 100 bytes each)


@dataclass(slots=True)
class MediaCacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    decodes: int = 0  # decode + preprocess runs (misses that did the work)


class MediaCache:
    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self._entries: OrderedDict[MediaKey, MediaLayout] = OrderedDict()
        self._flight: SingleFlight[MediaKey, MediaLayout] = SingleFlight()
        self._aliases: OrderedDict[bytes, MediaKey] = OrderedDict()
        self._pinned: Counter[MediaKey] = Counter()  # entry → live requests pinning it
        self.nbytes = 0
        self.stats = MediaCacheStats()

    @property
    def enabled(self) -> bool:
        return self.capacity > 0

    def __len__(self) -> int:
        return len(self._entries)

    def alias(self, alias: bytes, key: MediaKey) -> None:
        """Remember that ``alias`` (e.g. a data: URL's text) names the media ``key``."""
        self._aliases[alias] = key
        self._aliases.move_to_end(alias)
        if len(self._aliases) > MAX_ALIASES:
            self._aliases.popitem(last=False)

    def aliased(self, alias: bytes) -> MediaKey | None:
        key = self._aliases.get(alias)
        if key is not None:
            self._aliases.move_to_end(alias)
        return key

    def has(self, key: MediaKey) -> bool:
        """Held or being made: :meth:`get_or_make` will not call its ``make`` for ``key`` now."""
        return key in self._entries or key in self._flight

    def get(self, key: MediaKey) -> MediaLayout | None:
        layout = self._entries.get(key)
        if layout is not None:
            self._entries.move_to_end(key)
        return layout

    def put(self, key: MediaKey, layout: MediaLayout) -> None:
        """Keep ``layout``, evicting the least recently used entries no request pins; if pinned
        entries leave no room, it is not kept."""
        size = _size(layout)
        if size > self.capacity or key in self._entries:
            return
        while self.nbytes + size > self.capacity:
            victim = next((k for k in self._entries if k not in self._pinned), None)
            if victim is None:
                return
            self.nbytes -= _size(self._entries.pop(victim))
            self.stats.evictions += 1
        self._entries[key] = layout
        self.nbytes += size

    def pin(self, key: MediaKey) -> bool:
        """Keep ``key`` from eviction until :meth:`unpin`; False if it is not cached."""
        if key not in self._entries:
            return False
        self._pinned[key] += 1
        return True

    def unpin(self, key: MediaKey) -> None:
        self._pinned[key] -= 1
        if self._pinned[key] <= 0:
            del self._pinned[key]

    async def get_or_make(self, key: MediaKey, make: Make) -> tuple[MediaLayout, bool]:
        """The layout for ``key`` and whether it was a hit; ``make`` runs at most once per key at a time."""
        if not self.enabled:
            self.stats.misses += 1
            self.stats.decodes += 1
            return await make(), False
        layout = self.get(key)
        if layout is not None:
            self.stats.hits += 1
            return layout, True
        if key in self._flight:
            self.stats.hits += 1
        else:
            self.stats.misses += 1
            self.stats.decodes += 1
        layout, owner = await self._flight.run(key, lambda: self._make(key, make))
        return layout, not owner

    async def _make(self, key: MediaKey, make: Make) -> MediaLayout:
        layout = await make()
        self.put(key, layout)  # NOTE: in the shared task: kept even if the first caller is gone
        return layout


def _size(layout: MediaLayout) -> int:
    return layout.nbytes + ENTRY_OVERHEAD * (1 + len(layout.chunks))
