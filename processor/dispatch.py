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
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass

import torch

from mmcache.processor.cache_report import ChunkFate
from mmcache.processor.errors import APIError
from mmcache.processor.pipeline import Prepared, sampling_params
from mmcache.processor.preprocess import Chunk
from mmcache.processor.stages import Route, StageClients
from mmcache.shared.keys import ChunkKey
from mmcache.shared.media_spans import ChunkPlace, chunk_places
from mmcache.shared.messages import (
    EncodeItem,
    EncodeRequest,
    GenerateReply,
    GenerateRequest,
    LookupRequest,
    NeedEncode,
    ProbeRequest,
    Reencoded,
)
from mmcache.shared.rpc import RemoteError

log = logging.getLogger(__name__)

RETRY_PAUSE = 0.25  # seconds more before each further move (the first is at once)


@dataclass(frozen=True, slots=True)
class _Placed:
    """A chunk with its place in the prompt, its pixels and its encoder."""

    place: ChunkPlace
    chunk: Chunk
    source: str

    @property
    def end(self) -> int:
        return self.place.end

    @property
    def modality(self) -> str:
        return self.place.span.modality


class Dispatcher:
    def __init__(self, stages: StageClients, timeout: float, max_failovers: int = 3):
        self.stages = stages
        self.timeout = timeout
        self.max_failovers = max_failovers  # per request: LLM moves, and encoder rounds, each
        self.repairs: Counter[str] = Counter()  # NeedEncode answered, by the LLM stage's cause
        self.num_llm_retries = 0  # a request sent again, from the start, after its LLM replica died
        self.num_llm_migrations = 0  # a generation moved mid-answer, with its tokens so far
        self.num_encoder_retries = 0  # encoding sent again to new owners after an encoder died
        self.num_failover_exhausted = 0  # requests that ended because every move failed

    def stats(self) -> dict[str, float | dict[str, int]]:
        return {
            "repairs": {cause: self.repairs[cause] for cause in ("missing", "unreachable")},
            "failover_retries": {"llm": self.num_llm_retries, "encoder": self.num_encoder_retries},
            "failover_migrations": self.num_llm_migrations,
            "failover_exhausted": self.num_failover_exhausted,
            "unprobed_routes": self.stages.num_unprobed,
        }

    def _placed(self, prepared: Prepared) -> list[_Placed]:
        # NOTE: by key, not by position: a Qwen3-VL video has one span per chunk.
        chunks = {c.key: c for layout in prepared.media for c in layout.chunks}
        return [
            _Placed(p, chunks[p.key], self.stages.encoder_for(p.key)) for p in chunk_places(prepared.spans)
        ]

    async def generate(
        self, prepared: Prepared, index: int = 0, stream: bool = False
    ) -> AsyncGenerator[GenerateReply, None]:
        """Stream the chosen LLM replica's replies for choice ``index`` (``stream``: every step's
        tokens as they come, even when the client waits for the whole answer); leaving early
        aborts the generation.

        NOTE: when the replica dies (its connection drops), the request goes to another one, at
        most ``max_failovers`` times: sent again if nothing came yet, else moved with the tokens
        so far (``resume_token_ids``), so the caller sees each token once, in order.
        """
        ids = torch.tensor(prepared.token_ids, dtype=torch.int32)
        probe = ProbeRequest(ids, prepared.spans, prepared.salt)
        emitted: list[int] = []  # tokens the caller has had
        moves = 0
        while True:
            try:
                # NOTE: aclosing: a caller that stops early aborts the generation at once.
                async with contextlib.aclosing(self._attempt(prepared, probe, index, stream, emitted)) as it:
                    async for reply in it:
                        emitted.extend(reply.token_ids)
                        yield reply
                return
            except _ReplicaGone as gone:
                if moves >= self.max_failovers:
                    self.num_failover_exhausted += 1
                    raise APIError(
                        503,
                        f"no LLM replica could finish the request after {moves} move(s): {gone}",
                        "stage_unavailable",
                    ) from gone
                moves += 1
                if emitted:
                    self.num_llm_migrations += 1
                else:
                    self.num_llm_retries += 1
                log.warning(
                    "LLM replica lost (%s): moving the request (%d tokens so far)", gone, len(emitted)
                )
                await asyncio.sleep(RETRY_PAUSE * (moves - 1))  # NOTE: none before the first move

    async def _attempt(
        self, prepared: Prepared, probe: ProbeRequest, index: int, stream: bool, resume: list[int]
    ) -> AsyncGenerator[GenerateReply, None]:
        """One try at one LLM replica; raises :class:`_ReplicaGone` if it dies before the end."""
        try:
            route = await self.stages.route(probe, self.timeout)
        except ConnectionError as exc:  # none could be reached
            raise _ReplicaGone(str(exc)) from exc
        except RemoteError as exc:
            if _gone(exc):
                raise _ReplicaGone(str(exc)) from exc
            raise as_api_error(exc) from exc
        except TimeoutError as exc:
            raise APIError(504, "no LLM replica answered the probe in time", "stage_timeout") from exc
        sampling = sampling_params(prepared.req, len(prepared.token_ids), route.probe.max_model_len, index)
        placed, needed, found = await self._guard(
            # NOTE: chunks inside a prefix the shared KV store holds are not encoded either; should
            # the store lose them before the LLM reads them, the LLM asks for them (a repair).
            self._encoded(
                prepared, lambda p: p.end > max(route.probe.cached_tokens, route.probe.stored_tokens)
            )
        )
        # NOTE: a chunk the prompt holds twice, once inside the prefix, is counted by its needed place.
        skipped: dict[ChunkKey, ChunkFate] = {p.chunk.key: "prefix_skipped" for p in placed}
        prepared.report.attempt(index, skipped | found)
        request = GenerateRequest(
            prompt_token_ids=probe.prompt_token_ids,
            spans=prepared.spans,
            sources=[p.source for p in placed],
            handoff=_flags(placed, needed),
            sampling=sampling,
            salt=prepared.salt,
            probe_id=route.probe.probe_id,
            # Tokens are needed as they come only to stream them or to watch for stop strings.
            stream=stream or prepared.req.stream or bool(prepared.req.stop),
            resume_token_ids=list(resume),
        )
        try:
            async with route.client.stream(request, timeout=self.timeout) as replies:
                async for reply in replies:
                    if isinstance(reply, NeedEncode):
                        await self._repair(prepared, index, route, replies.rid, reply)
                    else:
                        yield reply
        except (ConnectionError, RemoteError) as exc:
            if _gone(exc):
                self.stages.llm_set.suspect(route.client.address)
                raise _ReplicaGone(str(exc)) from exc
            if isinstance(exc, RemoteError):
                raise as_api_error(exc) from exc
            raise APIError(503, str(exc), "stage_unavailable") from exc
        except TimeoutError as exc:
            raise APIError(504, "the LLM stage did not answer in time", "stage_timeout") from exc

    async def _repair(self, prepared: Prepared, index: int, route: Route, rid: int, need: NeedEncode) -> None:
        """The LLM stage could not read some chunks' rows (evicted, never encoded because its cached
        prefix covered them, encoder gone): encode them again from the pixels this request holds,
        and tell it to go on. The LLM stage bounds how often one request may ask."""
        log.info("repairing %d chunk(s) for a live request (%s)", len(need.keys), need.cause)
        self.repairs[need.cause] += 1
        missing = set(need.keys)
        # NOTE: owners are chosen again: an encoder may have gone
        placed, _, _ = await self._guard(self._encoded(prepared, lambda p: p.chunk.key in missing))
        prepared.report.repaired(index, list(missing))
        sources = [p.source for p in placed]
        await route.client.notify(Reencoded(rid, list(missing), sources))

    async def _encoded(
        self, prepared: Prepared, wanted: Callable[[_Placed], bool]
    ) -> tuple[list[_Placed], list[_Placed], dict[ChunkKey, ChunkFate]]:
        """Every chunk placed at its owner, the ``wanted`` ones there for sure: (placed, wanted,
        what became of each wanted chunk: found at its encoder or encoded, over every round).
        An owner that dies meanwhile is left out and its chunks go to the next owners, from the
        pixels this request holds (at most ``max_failovers`` rounds)."""
        found: dict[ChunkKey, ChunkFate] = {}
        for round_ in range(self.max_failovers + 1):
            placed = self._placed(prepared)
            needed = [p for p in placed if wanted(p)]
            try:
                await self._ensure_encoded(needed, found)
                return placed, needed, {p.chunk.key: found[p.chunk.key] for p in needed}
            except (ConnectionError, RemoteError) as exc:
                if not _gone(exc):
                    raise
                if round_ == self.max_failovers:
                    self.num_failover_exhausted += 1
                    raise APIError(
                        503,
                        f"no encoder replica could encode the request's media after {round_} move(s): {exc}",
                        "stage_unavailable",
                    ) from exc
                self.num_encoder_retries += 1
                self.stages.encoder_set.suspect()
                log.warning("encoder replica lost (%s): encoding at the next owners", exc)
                await asyncio.sleep(RETRY_PAUSE * round_)
        raise AssertionError("unreachable")

    async def _ensure_encoded(self, needed: list[_Placed], found: dict[ChunkKey, ChunkFate]) -> None:
        """Lookup at each owning encoder (pins what it has), then encode what it lacks; ``found``
        gets each chunk's fate (a miss stays one: a later round's lookup finds what this
        request had encoded). Every owner's part ends before a failure is raised, so nothing
        of a failed round still runs."""
        by_source: dict[str, list[_Placed]] = {}
        for p in needed:
            by_source.setdefault(p.source, []).append(p)

        async def one(source: str, group: list[_Placed]) -> None:
            keys = list(dict.fromkeys(p.chunk.key for p in group))
            timeout = self.stages.encoder_timeout(source, self.timeout)
            try:
                reply = await asyncio.wait_for(
                    self.stages.encoders[source].call(LookupRequest(keys), timeout=timeout), timeout
                )
            except TimeoutError as exc:
                if timeout < self.timeout:  # a replica out of the heartbeat: gone, not slow
                    raise ConnectionError(f"encoder replica {source} does not answer") from exc
                raise
            missing = set(reply.missing)
            for key in keys:
                if key in missing or found.get(key) == "encoder_misses":
                    found[key] = "encoder_misses"
                else:
                    found[key] = "encoder_hits"
            await self._encode([p for p in group if p.chunk.key in missing])

        results = await asyncio.gather(*(one(s, g) for s, g in by_source.items()), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result

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


class _ReplicaGone(Exception):
    """The LLM replica serving a try died (or none could be reached): try another."""


def _gone(exc: Exception) -> bool:
    """Does ``exc`` say the replica is gone (not that the request is bad)?"""
    if isinstance(exc, RemoteError):
        return exc.reply.code == "stage_unavailable"
    return isinstance(exc, ConnectionError)


def _flags(placed: list[_Placed], needed: list[_Placed]) -> list[bool]:
    """Per chunk: does this request hold a hand-off pin for it (it was looked up or encoded)?"""
    chosen = {id(p) for p in needed}
    return [id(p) in chosen for p in placed]


def as_api_error(exc: RemoteError) -> APIError:
    reply = exc.reply
    status = reply.status if 400 <= reply.status < 600 else 500
    return APIError(status, reply.message, reply.code)
