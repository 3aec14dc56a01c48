"""Pull embedding rows from the encoders that own them.

The scheduler asks only for rows its sequences lack (after the cached prefix,
or what a preemption lost): a chunk wholly inside the prefix costs nothing, a
chunk the prefix ends inside costs its tail. A row holds every feature set of
its token (the merged embedding, then the deepstack sets where the family has
them), so a tail fetch reads the tail of each set.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
import zmq

from mmcache.llm_stage.sequence import MediaRows
from mmcache.shared.keys import ChunkKey
from mmcache.shared.media_spans import ChunkPlace, chunk_places
from mmcache.shared.messages import FetchRequest, MediaSpan
from mmcache.shared.rpc import RemoteError, RpcClient

MAX_ENCODER_CLIENTS = 256  # encoder replicas this LLM replica keeps a socket to


@dataclass(frozen=True, slots=True)
class FetchResult:
    rows: list[MediaRows]  # what arrived, for the tokens asked for
    lost: dict[ChunkKey, str]  # chunk key → why its rows could not be read ("missing", "unreachable")
    unpinned: set[ChunkKey]  # hand-off pins the reads let go (the encoder releases a pin it reads)


@dataclass(frozen=True, slots=True)
class ChunkRef:
    """A chunk with its place in the prompt, and the encoder that holds its rows."""

    place: ChunkPlace
    source: str  # encoder address

    @property
    def start(self) -> int:  # first token of the chunk in the prompt
        return self.place.start

    @property
    def end(self) -> int:
        return self.place.end

    @property
    def key(self) -> ChunkKey:
        return self.place.key


def chunk_refs(spans: list[MediaSpan], sources: list[str]) -> list[ChunkRef]:
    """Every chunk of the prompt with its encoder (``sources``: spans in order, chunks in order)."""
    return [ChunkRef(place, source) for place, source in zip(chunk_places(spans), sources, strict=True)]


@dataclass(slots=True)
class FetchStats:
    fetches: int = 0
    rows: int = 0  # visual tokens
    feature_rows: int = 0  # rows of all feature sets: rows * feature sets
    chunks_skipped: int = 0  # wholly inside the cached prefix


def _cause(exc: Exception) -> str:
    """Why a chunk's rows could not be read: gone from its encoder, or the encoder did not answer
    (any other failure, a malformed reply included, is repaired the same way)."""
    if isinstance(exc, RemoteError) and exc.reply.code == "embedding_missing":
        return "missing"
    return "unreachable"


class MediaFetcher:
    def __init__(self, ctx: zmq.Context, timeout: float, hidden_size: int, feature_sets: int = 1):
        self._ctx = ctx
        self._hidden = hidden_size
        self._sets = feature_sets
        self._timeout = timeout
        self._clients: dict[str, RpcClient] = {}
        self.stats = FetchStats()

    def client(self, address: str) -> RpcClient:
        """The client of the encoder replica at ``address`` (as the processor found it).

        NOTE: bounded: the least recently used client beyond :data:`MAX_ENCODER_CLIENTS` is
        closed, and so is one whose call failed (see :meth:`_one`), so a replica that went away
        leaves no socket reconnecting to it."""
        client = self._clients.pop(address, None)
        if client is None:
            client = RpcClient(self._ctx, address, "encoder")
            while len(self._clients) >= MAX_ENCODER_CLIENTS:
                self._clients.pop(next(iter(self._clients))).close()
        self._clients[address] = client  # most recent last
        return client

    def forget(self, address: str) -> None:
        client = self._clients.pop(address, None)
        if client is not None:
            client.close()

    async def fetch(
        self, refs: list[ChunkRef], ranges: list[tuple[int, int]], pinned: frozenset[ChunkKey]
    ) -> FetchResult:
        """Rows for the media tokens in ``ranges`` (each ``[start, end)``).

        One read per distinct chunk, even when the prompt holds it twice (the same image sent
        again); a read of a chunk in ``pinned`` releases this request's hand-off pin there (listed
        in the result's ``unpinned``). A chunk that cannot be read is reported in ``lost``, not
        raised.
        """
        # (ref, first row, end row) of every chunk part inside the ranges
        wanted = [
            (r, max(lo, r.start) - r.start, min(hi, r.end) - r.start)
            for lo, hi in ranges
            for r in refs
            if r.end > lo and r.start < hi
        ]
        spans: dict[tuple[ChunkKey, str], tuple[int, int]] = {}  # rows to read per chunk
        for r, lo, hi in wanted:
            old = spans.get((r.key, r.source))
            spans[(r.key, r.source)] = (lo, hi) if old is None else (min(old[0], lo), max(old[1], hi))
        reads = list(spans.items())
        results = await asyncio.gather(
            *(self._one(key, source, lo, hi, key in pinned) for (key, source), (lo, hi) in reads),
            return_exceptions=True,
        )
        read: dict[tuple[ChunkKey, str], tuple[int, torch.Tensor]] = {}
        lost: dict[ChunkKey, str] = {}
        unpinned: set[ChunkKey] = set()
        for ((key, source), (lo, _)), res in zip(reads, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, Exception):
                    raise res  # cancelled
                lost[key] = _cause(res)
            else:
                read[(key, source)] = (lo, res)
                if key in pinned:
                    unpinned.add(key)
        out = []
        for r, lo, hi in wanted:
            if (r.key, r.source) in read:
                first, rows = read[(r.key, r.source)]
                out.append(MediaRows(r.start + lo, rows[lo - first : hi - first]))
        return FetchResult(out, lost, unpinned)

    async def _one(self, key: ChunkKey, source: str, lo: int, hi: int, release: bool) -> torch.Tensor:
        try:
            reply = await self.client(source).call(
                FetchRequest(key, lo, hi, release=release), timeout=self._timeout
            )
        except (TimeoutError, ConnectionError):
            self.forget(source)  # a gone replica leaves no socket reconnecting to it
            raise
        rows = reply.rows
        want = (hi - lo, self._sets, self._hidden)
        if tuple(rows.shape) != want or not rows.is_floating_point():
            raise RuntimeError(f"encoder {source} sent rows of shape {tuple(rows.shape)}, want {want}")
        self.stats.fetches += 1
        self.stats.rows += hi - lo
        self.stats.feature_rows += (hi - lo) * self._sets
        return rows

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
