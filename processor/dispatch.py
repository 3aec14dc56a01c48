"""The stages' part of the lazy cascade: route, encode what is missing, stream.

Probe the LLM replicas and pick one; skip chunks its cached prefix already
covers; ask each chunk's encoder which it lacks and send pixels for those
only; then stream from the LLM stage, which pulls the rows it needs. If rows
cannot be read when it needs them (evicted, never encoded because the cached
prefix covered them and that prefix was evicted since, encoder gone), it asks
with :class:`NeedEncode` on the live request, and we encode again from the
pixels we hold until the request ends: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from processor.errors import APIError
from processor.pipeline import Prepared, sampling_params
from processor.preprocess import Chunk
from processor.stages import Route, StageClients
from shared.media_spans import chunk_places
from shared.messages import (
    EncodeItem,
    EncodeRequest,
    GenerateChunk,
    GenerateRequest,
    LookupRequest,
    NeedEncode,
    ProbeRequest,
    Reencoded,
)
from shared.rpc import RemoteError

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Placed:
    """A chunk with its place in the prompt and its encoder."""

    start: int
    end: int
    modality: str
    chunk: Chunk
    source: str


class Dispatcher:
    def __init__(self, stages: StageClients, timeout: float):
        self.stages = stages
        self.timeout = timeout
        self.repairs: Counter[str] = Counter()  # NeedEncode answered, by the LLM stage's cause

    def stats(self) -> dict[str, dict[str, int]]:
        return {"repairs": {cause: self.repairs[cause] for cause in ("missing", "unreachable")}}

    def _placed(self, prepared: Prepared) -> list[_Placed]:
        # NOTE: by key, not by position: a Qwen3-VL video has one span per chunk.
        chunks = {c.key: c for layout in prepared.media for c in layout.chunks}
        return [
            _Placed(p.start, p.end, p.span.modality, chunks[p.key], self.stages.encoder_for(p.key))
            for p in chunk_places(prepared.spans)
        ]

    async def generate(
        self, prepared: Prepared, index: int = 0, stream: bool = False
    ) -> AsyncIterator[GenerateChunk]:
        """Stream the chosen LLM replica's replies for choice ``index`` (``stream``: every step's
        tokens as they come, even when the client waits for the whole answer); leaving early
        aborts the generation."""
        ids = torch.tensor(prepared.token_ids, dtype=torch.int32)
        probe = ProbeRequest(ids, prepared.spans, prepared.salt)
        route = await self._guard(self.stages.route(probe, self.timeout))
        sampling = sampling_params(prepared.req, len(prepared.token_ids), route.probe.max_model_len, index)
        placed = self._placed(prepared)
        needed = [p for p in placed if p.end > route.probe.cached_tokens]
        prepared.report.prefix_skipped = len(placed) - len(needed)
        await self._guard(self._ensure_encoded(prepared, needed))
        request = GenerateRequest(
            prompt_token_ids=ids,
            spans=prepared.spans,
            sources=[p.source for p in placed],
            handoff=_flags(placed, needed),
            sampling=sampling,
            salt=prepared.salt,
            probe_id=route.probe.probe_id,
            # Tokens are needed as they come only to stream them or to watch for stop strings.
            stream=stream or prepared.req.stream or bool(prepared.req.stop),
        )
        try:
            async with route.client.stream(request, timeout=self.timeout) as replies:
                async for reply in replies:
                    if isinstance(reply, NeedEncode):
                        await self._repair(prepared, route, replies.rid, reply)
                    else:
                        yield reply
        except RemoteError as exc:
            raise as_api_error(exc) from exc
        except TimeoutError as exc:
            raise APIError(504, "the LLM stage did not answer in time", "stage_timeout") from exc

    async def _repair(self, prepared: Prepared, route: Route, rid: int, need: NeedEncode) -> None:
        """The LLM stage could not read some chunks' rows (evicted, never encoded because its cached
        prefix covered them, encoder gone): encode them again from the pixels this request holds,
        and tell it to go on. The LLM stage bounds how often one request may ask."""
        log.info("repairing %d chunk(s) for a live request (%s)", len(need.keys), need.cause)
        self.repairs[need.cause] += 1
        placed = self._placed(prepared)  # NOTE: owners are chosen again: an encoder may have gone
        missing = set(need.keys)
        await self._guard(self._ensure_encoded(prepared, [p for p in placed if p.chunk.key in missing]))
        sources = [p.source for p in placed]
        await route.client.notify(Reencoded(rid, list(missing), sources))

    async def _ensure_encoded(self, prepared: Prepared, needed: list[_Placed]) -> None:
        """Lookup at each owning encoder (pins what it has), then encode what it lacks."""
        by_source: dict[str, list[_Placed]] = {}
        for p in needed:
            by_source.setdefault(p.source, []).append(p)

        async def one(source: str, group: list[_Placed]) -> None:
            keys = list(dict.fromkeys(p.chunk.key for p in group))
            reply = await self.stages.encoders[source].call(LookupRequest(keys), timeout=self.timeout)
            missing = set(reply.missing)
            prepared.report.encoder_hits += len(keys) - len(missing)
            prepared.report.encoder_misses += len(missing)
            await self._encode([p for p in group if p.chunk.key in missing])

        await asyncio.gather(*(one(s, g) for s, g in by_source.items()))

    async def _encode(self, placed: list[_Placed]) -> None:
        by_source: dict[str, dict[bytes, EncodeItem]] = {}
        for p in placed:
            by_source.setdefault(p.source, {})[p.chunk.key] = EncodeItem(
                p.chunk.key, p.modality, p.chunk.pixels
            )
        await asyncio.gather(
            *(
                self.stages.encoders[s].call(EncodeRequest(list(items.values())), timeout=self.timeout)
                for s, items in by_source.items()
            )
        )

    async def _guard(self, awaitable):
        try:
            return await awaitable
        except RemoteError as exc:
            raise as_api_error(exc) from exc
        except TimeoutError as exc:
            raise APIError(504, "a stage did not answer in time", "stage_timeout") from exc
        except ConnectionError as exc:
            raise APIError(503, str(exc), "stage_unavailable") from exc


def _flags(placed: list[_Placed], needed: list[_Placed]) -> list[bool]:
    """Per chunk: does this request hold a hand-off pin for it (it was looked up or encoded)?"""
    chosen = {id(p) for p in needed}
    return [id(p) in chosen for p in placed]


def as_api_error(exc: RemoteError) -> APIError:
    reply = exc.reply
    status = reply.status if 400 <= reply.status < 600 else 500
    return APIError(status, reply.message, reply.code)
