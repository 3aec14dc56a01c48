"""A request's cache counts, ``usage.mm_cache``: the one place they are written.

The README defines the fields: ``processor_hits`` / ``processor_misses`` count the request's
media items (their layout was cached, or made); ``encoder_hits`` / ``encoder_misses`` /
``prefix_skipped`` count its chunks: found at their encoder, encoded for it, or covered by the
LLM replica's cached prefix, so neither encoded nor fetched.

Each choice of an ``n > 1`` request is its own generation, so each counts the request's chunks
once: the sums run over choices. Within a choice every chunk counts once, however many tries it
took: a new try at another LLM replica decides afresh (its probe, its lookups), a chunk
encoded in any round of one try (an encoder died and the round was sent again) is a miss, and
a chunk a repair encoded again is a miss (it was encoded for the request after all).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

from mmcache.shared.keys import ChunkKey

ChunkFate = Literal["encoder_hits", "encoder_misses", "prefix_skipped"]
FIELDS = ("processor_hits", "processor_misses", "encoder_hits", "encoder_misses", "prefix_skipped")


@dataclass(slots=True)
class CacheReport:
    processor_hits: int = 0
    processor_misses: int = 0
    _fates: dict[int, dict[ChunkKey, ChunkFate]] = field(default_factory=dict)  # choice → chunk → fate

    def media(self, hit: bool) -> None:
        """One media item's layout was found in the processor cache, or made."""
        if hit:
            self.processor_hits += 1
        else:
            self.processor_misses += 1

    def attempt(self, choice: int, fates: dict[ChunkKey, ChunkFate]) -> None:
        """A try of ``choice`` at an LLM replica placed every chunk: what it found replaces what
        an earlier try of that choice found."""
        self._fates[choice] = dict(fates)

    def repaired(self, choice: int, keys: list[ChunkKey]) -> None:
        """A repair encoded ``keys`` again for ``choice``."""
        self._fates.setdefault(choice, {}).update(dict.fromkeys(keys, "encoder_misses"))

    def _count(self, fate: ChunkFate) -> int:
        return sum(Counter(fates.values())[fate] for fates in self._fates.values())

    @property
    def encoder_hits(self) -> int:
        return self._count("encoder_hits")

    @property
    def encoder_misses(self) -> int:
        return self._count("encoder_misses")

    @property
    def prefix_skipped(self) -> int:
        return self._count("prefix_skipped")

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in FIELDS}
