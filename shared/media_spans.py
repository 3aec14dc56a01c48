"""Walking a prompt's media: every chunk with its place, in prompt order.

A :class:`~shared.messages.MediaSpan` covers ``num_tokens`` placeholder tokens
from its offset; chunk ``i`` covers ``tokens_per_chunk`` of them. Every stage
that needs "which chunk sits where" walks the spans through :func:`chunk_places`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mmcache.shared.keys import ChunkKey
from mmcache.shared.messages import MediaSpan


@dataclass(frozen=True, slots=True)
class ChunkPlace:
    """One chunk of a media item: its placeholder tokens ``[start, end)`` in the prompt."""

    start: int
    end: int
    key: ChunkKey
    span: MediaSpan
    index: int  # within its span


def chunk_places(spans: Iterable[MediaSpan]) -> Iterator[ChunkPlace]:
    """Every chunk of ``spans`` in prompt order.

    NOTE: spans are built in prompt order and the LLM stage refuses others; sorting here anyway
    keeps the block-hash definition independent of the order a caller lists them in."""
    for span in sorted(spans, key=_offset):
        n = span.tokens_per_chunk
        for i, key in enumerate(span.chunk_keys):
            start = span.offset + i * n
            yield ChunkPlace(start, start + n, key, span, i)


def _offset(span: MediaSpan) -> int:
    return span.offset
