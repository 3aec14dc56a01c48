"""Pull embedding rows from the encoders that own them.

Only rows at or after the cached prefix are fetched: a chunk wholly inside
the prefix costs nothing, a chunk the prefix ends inside costs its tail.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import torch
import zmq.asyncio

from llm_stage.sequence import MediaRows, Sequence
from shared.messages import FetchRequest, MediaSpan
from shared.rpc import RemoteError, RpcClient

MAX_ENCODER_CLIENTS = 256  # encoder replicas this LLM replica keeps a socket to


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

    async def fetch(self, seq: Sequence, refs: list[ChunkRef], start: int, end: int) -> list[MediaRows]:
        """Rows for the media tokens in ``[start, end)``; raises :class:`MissingEmbeddings`.

        One fetch per distinct chunk, even when the prompt holds it twice (the same image sent
        again): its hand-off pin is released by that single read.
        """
        # (ref, first row, end row) of every chunk that overlaps [start, end)
        wanted = [
            (r, max(start, r.start) - r.start, min(end, r.end) - r.start)
            for r in refs
            if r.end > start and r.start < end
        ]
        self.stats.chunks_skipped += sum(1 for r in refs if r.end <= start)
        spans: dict[tuple[bytes, str], tuple[int, int, bool]] = {}  # rows to read per chunk
        for r, lo, hi in wanted:
            old = spans.get((r.key, r.source))
            spans[(r.key, r.source)] = (
                (lo, hi, r.handoff)
                if old is None
                else (min(old[0], lo), max(old[1], hi), old[2] or r.handoff)
            )
        results = await asyncio.gather(
            *(self._one(key, source, *rows) for (key, source), rows in spans.items()), return_exceptions=True
        )
        missing = [
            key for (key, _), res in zip(spans, results, strict=True) if isinstance(res, MissingEmbeddings)
        ]
        if missing:
            raise MissingEmbeddings(missing)
        for res in results:
            if isinstance(res, BaseException):
                raise res
        read = {ks: (rows[0], res) for (ks, rows), res in zip(spans.items(), results, strict=True)}
        out = []
        for r, lo, hi in wanted:
            first, rows = read[(r.key, r.source)]
            out.append(MediaRows(r.start + lo, rows[lo - first : hi - first]))
        return out

    async def _one(self, key: bytes, source: str, lo: int, hi: int, release: bool) -> torch.Tensor:
        try:
            reply = await self.client(source).call(
                FetchRequest(key, lo, hi, release=release), timeout=self._timeout
            )
        except RemoteError as exc:
            if exc.reply.code == "embedding_missing":
                raise MissingEmbeddings([key]) from exc
            raise
        except (TimeoutError, ConnectionError):
            self.forget(source)
            raise
        rows = reply.rows
        if tuple(rows.shape) != (hi - lo, self._hidden) or not rows.is_floating_point():
            raise RuntimeError(
                f"encoder {source} sent rows of shape {tuple(rows.shape)}, want {(hi - lo, self._hidden)}"
            )
        self.stats.fetches += 1
        self.stats.rows += hi - lo
        return rows

    def close(self) -> None:
        for client in self._clients.values():
            client.close()
