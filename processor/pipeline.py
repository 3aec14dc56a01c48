"""Orchestration of one chat request: media → prompt → encoder → LLM stream.

The processor does only what the caches cannot answer (design.md, the lazy
cascade); each step here is one stage of that cascade.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from processor.errors import APIError, bad_request
from processor.media_decode import DecodeLimits, decode_image, decode_video
from processor.media_source import MediaSource
from processor.preprocess import MediaLayout, Preprocessor
from processor.prompt import PromptBuilder
from processor.request import ChatRequest, MediaRef
from processor.stages import StageClients
from shared.config import ProcessorConfig
from shared.messages import (
    EncodeItem,
    EncodeRequest,
    GenerateChunk,
    GenerateRequest,
    MediaSpan,
    SamplingParams,
)
from shared.rpc import RemoteError

log = logging.getLogger(__name__)


@dataclass(slots=True)
class CacheReport:
    """Per-request cache counts (``usage.mm_cache``)."""

    processor_hits: int = 0
    processor_misses: int = 0
    encoder_hits: int = 0
    encoder_misses: int = 0
    prefix_skipped: int = 0

    def as_dict(self) -> dict[str, int]:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(slots=True)
class Prepared:
    token_ids: list[int]
    spans: list[MediaSpan]
    media: list[MediaLayout]
    sampling: SamplingParams
    salt: str | None
    report: CacheReport = field(default_factory=CacheReport)


class Pipeline:
    def __init__(
        self,
        cfg: ProcessorConfig,
        stages: StageClients,
        source: MediaSource,
        pre: Preprocessor,
        prompts: PromptBuilder,
    ):
        self.cfg = cfg
        self.stages = stages
        self.source = source
        self.pre = pre
        self.prompts = prompts
        self.limits = DecodeLimits(
            cfg.max_image_pixels, cfg.video_fps, cfg.max_video_frames, cfg.max_video_seconds
        )
        self._media_pool = ThreadPoolExecutor(
            max(2, min(8, (torch.get_num_threads() or 2))), thread_name_prefix="media"
        )

    # --- preparation: everything before the model runs ------------------------------

    async def prepare(self, req: ChatRequest) -> Prepared:
        if len(req.media) > self.cfg.max_media_items:
            raise bad_request(
                f"request has {len(req.media)} media items; the limit is {self.cfg.max_media_items}",
                "too_many_media_items",
                "messages",
            )
        report = CacheReport()
        media = list(await asyncio.gather(*(self._media(ref, req.cache_salt, report) for ref in req.media)))
        token_ids, spans = self.prompts.build(req.messages, media)
        sampling = await self._sampling(req, len(token_ids))
        return Prepared(token_ids, spans, media, sampling, req.cache_salt, report)

    async def _media(self, ref: MediaRef, salt: str | None, report: CacheReport) -> MediaLayout:
        if ref.url is None:
            raise bad_request(
                f"{ref.param}: uuid {ref.uuid!r} has no data and no cache knows it", "unknown_uuid", ref.param
            )
        data = await self.source.fetch(ref.url, ref.param)
        loop = asyncio.get_running_loop()
        report.processor_misses += 1
        return await loop.run_in_executor(self._media_pool, self._decode, ref, data, salt)

    def _decode(self, ref: MediaRef, data: bytes, salt: str | None) -> MediaLayout:
        if ref.modality == "image":
            return self.pre.image(decode_image(data, self.limits, ref.param), salt)
        return self.pre.video(decode_video(data, self.limits, ref.param), salt)

    async def _sampling(self, req: ChatRequest, prompt_len: int) -> SamplingParams:
        client = self.stages.llm()
        try:
            context = await self.stages.max_model_len(client, timeout=5.0)
        except ConnectionError as exc:
            raise APIError(503, str(exc), "stage_unavailable") from exc
        if prompt_len >= context:
            raise bad_request(
                f"prompt is {prompt_len} tokens (media included); the model's context is {context} tokens",
                "context_length_exceeded",
                "messages",
            )
        max_tokens = req.max_tokens if req.max_tokens is not None else context - prompt_len
        if prompt_len + max_tokens > context:
            raise bad_request(
                f"prompt ({prompt_len} tokens) plus max_tokens ({max_tokens}) "
                f"exceeds the context of {context}",
                "context_length_exceeded",
                "max_tokens",
            )
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=req.temperature,
            top_p=req.top_p,
            top_k=req.top_k,
            seed=req.seed,
            stop_token_ids=list(req.stop_token_ids),
            ignore_eos=req.ignore_eos,
        )

    # --- execution ---------------------------------------------------------------------

    async def _encode(self, prepared: Prepared) -> list[torch.Tensor]:
        items = [EncodeItem(c.key, m.modality, c.pixels) for m in prepared.media for c in m.chunks]
        if not items:
            return []
        prepared.report.encoder_misses += len(items)
        reply = await self._call(
            self.stages.encoder().call(EncodeRequest(items), timeout=self.cfg.stage_timeout)
        )
        return reply.embeddings

    async def generate(self, prepared: Prepared) -> AsyncIterator[GenerateChunk]:
        """Stream the LLM stage's replies; leaving early aborts the generation."""
        embeddings = await self._encode(prepared)
        request = GenerateRequest(
            prompt_token_ids=torch.tensor(prepared.token_ids, dtype=torch.int32),
            spans=prepared.spans,
            embeddings=embeddings,
            sampling=prepared.sampling,
            salt=prepared.salt,
        )
        try:
            async with self.stages.llm().stream(request, timeout=self.cfg.stage_timeout) as replies:
                async for chunk in replies:
                    yield chunk
        except RemoteError as exc:
            raise _as_api_error(exc) from exc
        except TimeoutError as exc:
            raise APIError(504, "the LLM stage did not answer in time", "stage_timeout") from exc

    async def _call(self, awaitable):
        try:
            return await awaitable
        except RemoteError as exc:
            raise _as_api_error(exc) from exc
        except TimeoutError as exc:
            raise APIError(504, "a stage did not answer in time", "stage_timeout") from exc

    def close(self) -> None:
        self._media_pool.shutdown(wait=False, cancel_futures=True)


def _as_api_error(exc: RemoteError) -> APIError:
    reply = exc.reply
    status = reply.status if 400 <= reply.status < 600 else 500
    return APIError(status, reply.message, reply.code)
