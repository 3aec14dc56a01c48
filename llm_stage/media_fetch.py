"""Pull embedding rows from the encoders that own them.

Only rows at or after the cached prefix are fetched: a chunk wholly inside
the prefix costs nothing, a chunk the prefix ends inside costs its tail.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import zmq.asyncio

from llm_stage.sequence import MediaRows, Sequence
from shared.messages import FetchRequest, MediaSpan
from shared.rpc import RemoteError, RpcClient


class MissingEmbeddings(Exception):
    def __init__(self, keys: list[bytes]):
        super().__init__(f"{len(keys)} chunk(s) missing at their encoders")
        self.keys = keys


@dataclass(frozen=True, slots=True)
class ChunkRef:
    start: int  # first token of the chunk in the prompt
    end: int
    key: bytes
    source: str  # encoder address
    handoff: bool  # this request holds a hand-off pin there


def chunk_refs(spans: list[MediaSpan], sources: list[str], handoff: list[bool]) -> list[ChunkRef]:
    refs: list[ChunkRef] = []
    for span in sorted(spans, key=lambda s: s.offset):
        n = span.tokens_per_chunk
        for i, key in enumerate(span.chunk_keys):
            j = len(refs)
            refs.append(ChunkRef(span.offset + i * n, span.offset + (i + 1) * n, key, sources[j], handoff[j]))
    return refs


@dataclass(slots=True)
class FetchStats:
    fetches: int = 0
    rows: int = 0
    chunks_skipped: int = 0  # wholly inside the cached prefix


class MediaFetcher:
    def __init__(self, ctx: zmq.asyncio.Context, timeout: float, hidden_size: int):
        self._ctx = ctx
        self._hidden = hidden_size
        self._timeout = timeout
        self._clients: dict[str, RpcClient] = {}
        self.stats = FetchStats()

    def client(self, address: str) -> RpcClient:
        client = self._clients.get(address)
        if client is None:
            client = self._clients[address] = RpcClient(self._ctx, address, "encoder")
        return client

    async def fetch(self, seq: Sequence, refs: list[ChunkRef], start: int, end: int) -> list[MediaRows]:
        """Rows for the media tokens in ``[start, end)``; raises :class:`MissingEmbeddings`."""
        wanted = [r for r in refs if r.end > start and r.start < end]
        self.stats.chunks_skipped += sum(1 for r in refs if r.end <= start)
        results = await asyncio.gather(*(self._one(r, start, end) for r in wanted), return_exceptions=True)
        missing = [
            r.key for r, res in zip(wanted, results, strict=True) if isinstance(res, MissingEmbeddings)
        ]
        if missing:
            raise MissingEmbeddings(missing)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        return [res for res in results if isinstance(res, MediaRows)]

    async def _one(self, ref: ChunkRef, start: int, end: int) -> MediaRows:
        lo, hi = max(start, ref.start), min(end, ref.end)
        request = FetchRequest(ref.key, lo - ref.start, hi - ref.start, release=ref.handoff)
        try:
            reply = await self.client(ref.source).call(request, timeout=self._timeout)
        except RemoteError as exc:
            if exc.reply.code == "embedding_missing":
                raise MissingEmbeddings([ref.key]) from exc
            raise
        rows = reply.rows
        if tuple(rows.shape) != (hi - lo, self._hidden) or not rows.is_floating_point():
            raise RuntimeError(
                f"encoder {ref.source} sent rows of shape {tuple(rows.shape)}, want {(hi - lo, self._hidden)}"
            )
        self.stats.fetches += 1
        self.stats.rows += hi - lo
        return MediaRows(lo, rows)

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
