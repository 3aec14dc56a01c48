"""The stages' part of the lazy cascade (design.md, steps 4-6).

Probe the LLM replicas and pick one; skip chunks its cached prefix already
covers; ask each chunk's encoder which it lacks and send pixels for those
only; then stream from the LLM stage, which pulls the rows it needs. If an
embedding vanished meanwhile the LLM stage answers :class:`NeedEncode`, and we
encode again from the pixels we still hold: slower, never wrong.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import torch

from processor.errors import APIError
from processor.pipeline import Prepared, sampling_params
from processor.preprocess import Chunk
from processor.stages import Route, StageClients
from shared.messages import (
    EncodeItem,
    EncodeRequest,
    GenerateChunk,
    GenerateRequest,
    LookupRequest,
    NeedEncode,
    ProbeRequest,
)
from shared.rpc import RemoteError

log = logging.getLogger(__name__)

MAX_REPAIRS = 2


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
        self.num_repairs = 0  # generate attempts answered with NeedEncode

    def stats(self) -> dict[str, dict[str, int]]:
        return {"repairs": {"need_encode": self.num_repairs}}

    def _placed(self, prepared: Prepared) -> list[_Placed]:
        out = []
        for span, layout in zip(prepared.spans, prepared.media, strict=True):
            n = span.tokens_per_chunk
            for i, chunk in enumerate(layout.chunks):
                start = span.offset + i * n
                out.append(
                    _Placed(start, start + n, span.modality, chunk, self.stages.encoder_for(chunk.key))
                )
        return out

    async def generate(self, prepared: Prepared) -> AsyncIterator[GenerateChunk]:
        """Stream the chosen LLM replica's replies; leaving early aborts the generation."""
        ids = torch.tensor(prepared.token_ids, dtype=torch.int32)
        probe = ProbeRequest(ids, prepared.spans, prepared.salt)
        route = await self._guard(self.stages.route(probe, self.timeout))
        sampling = sampling_params(prepared.req, len(prepared.token_ids), route.probe.max_model_len)
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
            stream=prepared.req.stream or bool(prepared.req.stop),
        )
        for _ in range(MAX_REPAIRS + 1):
            missing = None
            async with contextlib.aclosing(self._stream(route, request)) as replies:
                async for reply in replies:
                    if isinstance(reply, NeedEncode):
                        missing = set(reply.keys)
                        break
                    yield reply
            if missing is None:
                return
            log.info("repairing %d chunk(s) that left their encoders", len(missing))
            self.num_repairs += 1
            # Redo step 5 for every chunk the LLM stage may pull: the lookup pins the ones still
            # there again (the failed attempt's fetches released their pins) and the rest are
            # encoded from the pixels we hold.
            needed = [p for p in placed if p.end > route.probe.cached_tokens or p.chunk.key in missing]
            await self._guard(self._ensure_encoded(prepared, needed))
            request = dataclasses.replace(request, probe_id=0, handoff=_flags(placed, needed))
        raise APIError(503, "embeddings kept vanishing from the encoders; retry later", "encoder_churn")

    async def _stream(
        self, route: Route, request: GenerateRequest
    ) -> AsyncIterator[GenerateChunk | NeedEncode]:
        try:
            async with route.client.stream(request, timeout=self.timeout) as replies:
                async for reply in replies:
                    yield reply
        except RemoteError as exc:
            raise as_api_error(exc) from exc
        except TimeoutError as exc:
            raise APIError(504, "the LLM stage did not answer in time", "stage_timeout") from exc

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
