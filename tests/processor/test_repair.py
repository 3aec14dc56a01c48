"""Miss repair: an embedding that vanishes between the processor's lookup and the LLM stage's
fetch (eviction, encoder restart) is encoded again from the pixels the processor holds. Slower,
never wrong, never a 5xx.

Real encoder and LLM services talk real ZeroMQ (ipc) inside this process; the fault is injected by
an encoder that forgets entries right after answering a lookup.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import zmq.asyncio

from mmcache.encoder_stage.service import EncoderService
from mmcache.encoder_stage.vision import VisionTower
from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.media_fetch import MediaFetcher
from mmcache.llm_stage.service import LLMService
from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.media_source import MediaSource
from mmcache.processor.pipeline import Pipeline
from mmcache.processor.preprocess import Preprocessor
from mmcache.processor.prompt import PromptBuilder
from mmcache.processor.request import parse_chat_request
from mmcache.processor.stages import StageClients
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import EncoderConfig, LLMConfig, ProcessorConfig
from mmcache.shared.messages import LookupRequest
from mmcache.shared.rpc import RpcServer
from tests.media import data_url, image_bytes


class ForgetfulEncoder(EncoderService):
    """Evicts every entry a lookup reported present, right after the reply (the worst moment)."""

    forget = False

    def quick(self, msg, reply):
        handled = super().quick(msg, reply)
        if self.forget and isinstance(msg, LookupRequest):
            for key in msg.keys:
                self.cache._entries.pop(self.key(key), None)
        return handled


@contextlib.asynccontextmanager
async def stack(model: Path, tmp: Path):
    spec = ModelSpec.load(model)
    ctx = zmq.asyncio.Context()
    enc_addr, llm_addr = f"ipc://{tmp}/enc.sock", f"ipc://{tmp}/llm.sock"
    encoder = ForgetfulEncoder(EncoderConfig(model=str(model)), VisionTower(spec))
    llm_cfg = LLMConfig(model=str(model), num_kv_blocks=256)
    engine = Engine(llm_cfg, spec)
    llm = LLMService(llm_cfg, engine, MediaFetcher(ctx, 10.0, engine.lm.config.hidden_size))
    servers = [
        RpcServer(ctx, enc_addr, encoder.handle, quick=encoder.quick),
        RpcServer(ctx, llm_addr, llm.handle, quick=llm.quick),
    ]
    tasks = [asyncio.create_task(s.serve_forever()) for s in servers]
    cfg = ProcessorConfig(model=str(model), encoder=enc_addr, llm=llm_addr)
    stages = StageClients(ctx, [enc_addr], [llm_addr])
    pipeline = Pipeline(
        cfg, MediaSource([], cfg.max_media_bytes, None), Preprocessor(cfg.model, 2.0, 64), PromptBuilder(spec)
    )
    try:
        yield encoder, pipeline, Dispatcher(stages, 30.0), llm
    finally:
        for t in tasks:
            t.cancel()
        stages.close()
        for s in servers:
            s.close()
        encoder.close()
        llm.close()
        pipeline.close()
        ctx.destroy(linger=0)


async def answer(pipeline: Pipeline, dispatcher: Dispatcher, body: dict) -> tuple[list[int], object]:
    prepared = await pipeline.prepare(parse_chat_request(body))
    out: list[int] = []
    try:
        async for chunk in dispatcher.generate(prepared):
            out += chunk.token_ids
    finally:
        pipeline.done(prepared)
    return out, prepared.report


def body(img: bytes, system: str) -> dict:
    return {
        "model": "m",
        "max_tokens": 10,
        "temperature": 0,
        "messages": [
            {"role": "system", "content": system},
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(img, "image/png")}},
                    {"type": "text", "text": "What is it?"},
                ],
            },
        ],
    }


async def test_entry_evicted_between_lookup_and_fetch_is_repaired(tiny_model, tmp_path):
    img = image_bytes(448, 448, seed=77)
    async with stack(tiny_model, tmp_path) as (encoder, pipeline, dispatcher, llm):
        reference, _ = await answer(pipeline, dispatcher, body(img, "first"))
        forwards = encoder.batcher.stats.forwards
        encoder.forget = True
        # Another system prompt, so the prefix cache cannot cover the image: the LLM must fetch it.
        repaired, report = await answer(pipeline, dispatcher, body(img, "second one"))
        # The lookup found it, the fetch did not: one repair encode. usage.mm_cache counts the
        # chunk once, as encoded for the request (README: a miss), not as a hit and a miss.
        assert report.as_dict() == {
            "processor_hits": 1,
            "processor_misses": 0,
            "encoder_hits": 0,
            "encoder_misses": 1,
            "prefix_skipped": 0,
        }
        assert encoder.batcher.stats.forwards == forwards + 1
        assert dict(llm.rows.repairs) == {"missing": 1}  # asked for on the live request, once
        assert dispatcher.repairs == {"missing": 1}
        encoder.forget = False
        fresh, _ = await answer(pipeline, dispatcher, body(img, "second one"))
    assert repaired == fresh
    assert reference  # non-empty greedy answers
