"""``usage.mm_cache`` against the README's definitions, for n = 1 and n = 3, with an encoder round
sent again and with a repair (the repair case: tests/processor/test_repair.py).

Real encoder and LLM services talk real ZeroMQ (ipc) inside this process, as in test_repair; the
encoder fault is a replica that answers a lookup as one going away (``stage_unavailable``).
The counts are checked against what the encoders did (chunks encoded) and the LLM stage saw.
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
from mmcache.processor.choices import choices
from mmcache.processor.dispatch import Dispatcher
from mmcache.processor.media_source import MediaSource
from mmcache.processor.pipeline import Pipeline
from mmcache.processor.preprocess import Preprocessor
from mmcache.processor.prompt import PromptBuilder
from mmcache.processor.request import parse_chat_request
from mmcache.processor.stages import StageClients
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import EncoderConfig, LLMConfig, ProcessorConfig
from mmcache.shared.messages import ErrorReply, LookupRequest
from mmcache.shared.rpc import RpcServer
from tests.media import data_url, image_bytes

QUESTION = " ".join(["Describe the pictures above, their colours and shapes, in a few words."] * 4)


class FlakyEncoder(EncoderService):
    """Answers its next ``fail_lookups`` lookups as a replica going away."""

    fail_lookups = 0

    def quick(self, msg, reply):
        if isinstance(msg, LookupRequest) and self.fail_lookups:
            self.fail_lookups -= 1
            reply.send_nowait(ErrorReply("stage_unavailable", "this encoder is going away", 503))
            return True
        return super().quick(msg, reply)


@contextlib.asynccontextmanager
async def stack(model: Path, tmp: Path, num_encoders: int):
    spec = ModelSpec.load(model)
    ctx = zmq.asyncio.Context()
    enc_addrs = [f"ipc://{tmp}/enc{i}.sock" for i in range(num_encoders)]
    llm_addr = f"ipc://{tmp}/llm.sock"
    tower = VisionTower(spec)
    encoders = [FlakyEncoder(EncoderConfig(model=str(model)), tower) for _ in enc_addrs]
    llm_cfg = LLMConfig(model=str(model), num_kv_blocks=512)
    engine = Engine(llm_cfg, spec)
    llm = LLMService(llm_cfg, engine, MediaFetcher(ctx, 10.0, engine.lm.config.hidden_size))
    servers = [RpcServer(ctx, a, e.handle, quick=e.quick) for a, e in zip(enc_addrs, encoders, strict=True)]
    servers.append(RpcServer(ctx, llm_addr, llm.handle, quick=llm.quick))
    tasks = [asyncio.create_task(s.serve_forever()) for s in servers]
    cfg = ProcessorConfig(model=str(model), encoder=enc_addrs[0], llm=llm_addr)
    stages = StageClients(ctx, enc_addrs, [llm_addr])
    pipeline = Pipeline(
        cfg, MediaSource([], cfg.max_media_bytes, None), Preprocessor(cfg.model, 2.0, 64), PromptBuilder(spec)
    )
    try:
        yield encoders, pipeline, Dispatcher(stages, 30.0), llm
    finally:
        for t in tasks:
            t.cancel()
        stages.close()
        for s in servers:
            s.close()
        for e in encoders:
            e.close()
        llm.close()
        pipeline.close()
        ctx.destroy(linger=0)


def body(images: list[bytes], system: str, n: int = 1) -> dict:
    pictures = [{"type": "image_url", "image_url": {"url": data_url(img, "image/png")}} for img in images]
    return {
        "model": "m",
        "max_tokens": 6,
        "temperature": 0,
        "n": n,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": [*pictures, {"type": "text", "text": QUESTION}]},
        ],
    }


async def answer(
    pipeline: Pipeline, dispatcher: Dispatcher, request: dict
) -> tuple[dict[int, list[int]], dict]:
    """Tokens per choice, and ``usage.mm_cache``."""
    prepared = await pipeline.prepare(parse_chat_request(request))
    out: dict[int, list[int]] = {}
    try:
        async for index, reply in choices(dispatcher, prepared, lambda i: False):
            out.setdefault(index, []).extend(reply.token_ids)
    finally:
        pipeline.done(prepared)
    return out, prepared.report.as_dict()


def encoded(encoders: list[EncoderService]) -> int:
    return sum(e.batcher.stats.chunks for e in encoders)


async def test_n3_counts_each_choices_chunks_once(tiny_model, tmp_path):
    images = [image_bytes(224, 224, seed=s) for s in (11, 12)]
    async with stack(tiny_model, tmp_path, 1) as (encoders, pipeline, dispatcher, llm):
        tokens, report = await answer(pipeline, dispatcher, body(images, "cold", n=3))
        # Choice 0 had both chunks encoded; choices 1 and 2 came after its prefill, whose cached
        # prefix covers both images: neither encoded nor fetched for them.
        assert report == {
            "processor_hits": 0,
            "processor_misses": 2,  # media items: prepared once for the request
            "encoder_hits": 0,
            "encoder_misses": 2,
            "prefix_skipped": 4,
        }
        assert encoded(encoders) == 2
        assert llm.fetcher.stats.chunks_skipped == 4  # what the LLM stage saw agrees
        assert len(tokens) == 3 and tokens[0] and tokens[0] == tokens[1] == tokens[2]  # greedy

        # Warm, with another system prompt: no prefix covers the images, the encoder has them.
        tokens_warm, report = await answer(pipeline, dispatcher, body(images, "warm again", n=3))
        assert report == {
            "processor_hits": 2,
            "processor_misses": 0,
            "encoder_hits": 2,  # choice 0
            "encoder_misses": 0,
            "prefix_skipped": 4,  # choices 1 and 2
        }
        assert encoded(encoders) == 2  # nothing encoded again
        assert tokens_warm[0] == tokens_warm[1] == tokens_warm[2]


async def images_owned_by_each(model: Path, dispatcher: Dispatcher, each: int) -> list[bytes]:
    """``each`` images per encoder replica, by rendezvous over this run's replica ids (they come
    from per-test addresses): the state the test checks is made, not hoped for. The chunk keys
    come from a throwaway pipeline, so the real one's processor cache stays cold."""
    cfg = ProcessorConfig(model=str(model))
    probe = Pipeline(
        cfg,
        MediaSource([], cfg.max_media_bytes, None),
        Preprocessor(cfg.model, 2.0, 64),
        PromptBuilder(ModelSpec.load(model)),
    )
    await dispatcher.stages.wait_started()
    owned: dict[str, list[bytes]] = {}
    try:
        for seed in range(21, 121):
            image = image_bytes(224, 224, seed=seed)
            prepared = await probe.prepare(parse_chat_request(body([image], "probe")))
            probe.done(prepared)
            owner = dispatcher.stages.encoder_for(prepared.spans[0].chunk_keys[0])
            if len(mine := owned.setdefault(owner, [])) < each:
                mine.append(image)
            if len(owned) > 1 and all(len(v) == each for v in owned.values()):
                return [img for v in owned.values() for img in v]
    finally:
        probe.close()
    raise AssertionError(f"no {each} images per encoder among 100 seeds: {owned.keys()}")


async def test_n1_counts_each_chunk_once_when_an_encoder_round_is_sent_again(tiny_model, tmp_path):
    async with stack(tiny_model, tmp_path, 2) as (encoders, pipeline, dispatcher, llm):
        images = await images_owned_by_each(tiny_model, dispatcher, 2)  # four: two per encoder
        encoders[1].fail_lookups = 1
        _, report = await answer(pipeline, dispatcher, body(images, "cold"))
        assert dispatcher.num_encoder_retries == 1  # the round was sent again
        assert all(e.batcher.stats.chunks for e in encoders)  # both owned some
        # encoder 0's chunks were encoded in the first round and found in the second: still misses
        assert report == {
            "processor_hits": 0,
            "processor_misses": 4,
            "encoder_hits": 0,
            "encoder_misses": 4,
            "prefix_skipped": 0,
        }
        assert encoded(encoders) == 4

        encoders[1].fail_lookups = 1
        _, report = await answer(pipeline, dispatcher, body(images, "warm, another system prompt"))
        assert dispatcher.num_encoder_retries == 2
        assert report == {
            "processor_hits": 4,
            "processor_misses": 0,
            "encoder_hits": 4,  # once each, though encoder 0 was asked twice
            "encoder_misses": 0,
            "prefix_skipped": 0,
        }
        assert encoded(encoders) == 4
        assert llm.fetcher.stats.chunks_skipped == 0
