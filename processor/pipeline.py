"""The processor's own part of the lazy cascade: media bytes → layouts (cached) → prompt tokens.

A media item costs a hash of its raw bytes and a cache lookup when seen
before; only new media are decoded and resized. A request pins its entries
until it ends: their pixels are what a mid-request repair encodes again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from mmcache.processor.cache_report import CacheReport
from mmcache.processor.errors import bad_request
from mmcache.processor.media_cache import MediaCache
from mmcache.processor.media_decode import DecodeLimits, decode_image, decode_video
from mmcache.processor.media_source import LocalFile, MediaSource
from mmcache.processor.preprocess import MediaLayout, Preprocessor
from mmcache.processor.prompt import PromptBuilder
from mmcache.processor.request import ChatRequest, MediaRef
from mmcache.shared.config import ProcessorConfig
from mmcache.shared.keys import MediaKey, data_url_alias, file_alias, media_key, uuid_media_key
from mmcache.shared.messages import MediaSpan, SamplingParams

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Prepared:
    """A request after the processor's own work: media laid out, prompt tokenised."""

    req: ChatRequest
    token_ids: list[int]
    spans: list[MediaSpan]
    media: list[MediaLayout]
    salt: str | None
    report: CacheReport = field(default_factory=CacheReport)
    pinned: list[MediaKey] = field(default_factory=list)  # cache entries pinned until the request ends


def sampling_params(req: ChatRequest, prompt_len: int, context: int, index: int = 0) -> SamplingParams:
    """Sampling for the LLM stage (of choice ``index``); refuses prompts that do not fit the context."""
    if prompt_len >= context:
        raise bad_request(
            f"prompt is {prompt_len} tokens (media included); the model's context is {context} tokens",
            "context_length_exceeded",
            "messages",
        )
    max_tokens = req.max_tokens if req.max_tokens is not None else context - prompt_len
    if prompt_len + max_tokens > context:
        raise bad_request(
            f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) exceeds the context of {context}",
            "context_length_exceeded",
            "max_tokens",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        # NOTE: choice i of a seeded request draws from seed + i: reproducible, and not n copies.
        seed=None if req.seed is None else (req.seed + index) % (1 << 63),
        stop_token_ids=list(req.stop_token_ids),
        ignore_eos=req.ignore_eos,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        repetition_penalty=req.repetition_penalty,
        logit_bias=dict(req.logit_bias),
        min_tokens=req.min_tokens,
        grammar=req.grammar,
        logprobs=req.top_logprobs if req.logprobs else None,
        prompt_logprobs=req.prompt_logprobs,
    )


class Pipeline:
    def __init__(self, cfg: ProcessorConfig, source: MediaSource, pre: Preprocessor, prompts: PromptBuilder):
        self.cfg = cfg
        self.source = source
        self.pre = pre
        self.prompts = prompts
        self.cache = MediaCache(cfg.processor_cache_bytes)
        self.limits = DecodeLimits(
            cfg.max_image_pixels, cfg.video_fps, cfg.max_video_frames, cfg.max_video_seconds
        )
        self._media_pool = ThreadPoolExecutor(min(8, os.cpu_count() or 2), thread_name_prefix="media")

    # --- preparation: everything before the model runs ------------------------------

    async def prepare(self, req: ChatRequest) -> Prepared:
        if len(req.media) > self.cfg.max_media_items:
            raise bad_request(
                f"request has {len(req.media)} media items; the limit is {self.cfg.max_media_items}",
                "too_many_media_items",
                "messages",
            )
        report = CacheReport()
        # NOTE: --no-cache gives every request its own namespace, so no tier can share anything.
        salt = secrets.token_hex(16) if self.cfg.no_cache else req.cache_salt
        pinned: list[MediaKey] = []
        try:
            if len(req.media) == 1:  # NOTE: no task (and no extra event-loop turn) for a single item
                media = [await self._media(req.media[0], salt, report, pinned)]
            else:
                media = list(
                    await asyncio.gather(*(self._media(ref, salt, report, pinned) for ref in req.media))
                )
            tools = req.tools.functions if req.tools is not None else None
            token_ids, spans = self.prompts.build(req.messages, media, tools)
        except BaseException:
            self._unpin(pinned)
            raise
        return Prepared(req, token_ids, spans, media, salt, report, pinned)

    def done(self, prepared: Prepared) -> None:
        """The request has ended: its media cache entries may be evicted again."""
        self._unpin(prepared.pinned)
        prepared.pinned.clear()

    def _unpin(self, keys: list[MediaKey]) -> None:
        for key in keys:
            self.cache.unpin(key)

    async def _media(
        self, ref: MediaRef, salt: str | None, report: CacheReport, pinned: list[MediaKey]
    ) -> MediaLayout:
        """Layout of one media item: a cache hit costs a hash of its bytes (or its uuid) and a lookup.
        The entry is pinned (appended to ``pinned``) until the request ends."""
        fp = self.pre.fingerprint
        data: bytes | None = None
        if ref.uuid is not None:
            key = uuid_media_key(salt, ref.modality, ref.uuid, fp)
            if ref.url is None and self.cache.get(key) is None:
                raise bad_request(
                    f"{ref.param}: uuid {ref.uuid!r} comes without data and no cache knows it",
                    "unknown_uuid",
                    ref.param,
                )
        elif ref.url is not None and ref.url[:5].lower() == "file:":
            # NOTE: a repeated local file is known by its path and settled stat signature, so a
            # hit does not even read it; the alias is only taken while its layout is pinned (a
            # layout made again must come from the bytes read then, not from the alias).
            local = self.source.file_signature(ref.url) if self.cache.enabled else None
            alias = self._file_alias(salt, ref.modality, local)
            known = self.cache.aliased(alias) if alias else None
            if known is not None and self.cache.has(known):
                key = known
            else:
                data, local = await self.source.fetch_file(ref.url, ref.param)
                key = media_key(salt, ref.modality, data, fp)
                alias = self._file_alias(salt, ref.modality, local) if self.cache.enabled else None
                if alias:
                    self.cache.alias(alias, key)
        else:
            # NOTE: a repeated data: URL is known by a hash of its text, so a hit skips even the
            # base64 decoding; the cache entry itself stays keyed by the raw bytes.
            location = _location(ref)
            alias = data_url_alias(salt, ref.modality, location, fp) if self.cache.enabled else None
            known = self.cache.aliased(alias) if alias else None
            if known is not None:
                key = known
            else:
                data = await self.source.fetch(location, ref.param)
                key = media_key(salt, ref.modality, data, fp)
                if alias:
                    self.cache.alias(alias, key)

        async def make() -> MediaLayout:
            raw = data if data is not None else await self.source.fetch(_location(ref), ref.param)
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._media_pool, self._decode, ref, raw, salt)

        layout, hit = await self.cache.get_or_make(key, make)
        if self.cache.pin(key):
            pinned.append(key)
        report.media(hit)
        return layout

    def _file_alias(self, salt: str | None, modality: str, local: LocalFile | None) -> bytes | None:
        """The alias of a local file's settled contents; None if it has none to trust yet."""
        if local is None or local.signature is None:
            return None
        return file_alias(salt, modality, local.path, local.signature, self.pre.fingerprint)

    def _decode(self, ref: MediaRef, data: bytes, salt: str | None) -> MediaLayout:
        if ref.modality == "image":
            return self.pre.image(decode_image(data, self.limits, ref.param), salt)
        return self.pre.video(decode_video(data, self.limits, ref.param), salt)

    def stats(self) -> dict[str, int | dict[str, int]]:
        """The processor cache's and the media source's numbers."""
        cache = self.cache
        return {
            "cache_hits": cache.stats.hits,
            "cache_misses": cache.stats.misses,
            "cache_evictions": cache.stats.evictions,
            "decodes": cache.stats.decodes,
            "cache_bytes": cache.nbytes,
            "cache_capacity_bytes": cache.capacity,
            "cache_entries": len(cache),
            **self.source.stats(),
        }

    def close(self) -> None:
        self._media_pool.shutdown(wait=False, cancel_futures=True)


def _location(ref: MediaRef) -> str | memoryview:
    """Where a media item's bytes are (its URL, or the data: URL the body pinned aside)."""
    location = ref.location
    if location is None:  # a uuid alone, and no cache knows it (any more)
        raise bad_request(f"{ref.param}: uuid {ref.uuid!r} comes without data", "unknown_uuid", ref.param)
    return location
