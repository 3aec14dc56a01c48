"""An LLM replica whose engine fails (a step raises outside the model call) leaves routing within
one heartbeat and its requests move to another replica: never a live replica that stops stepping.

Two real LLM services and an encoder talk real ZeroMQ (ipc) inside this process; the fault is
armed through the engine's fault hook.
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
from mmcache.shared.rpc import RpcServer


@contextlib.asynccontextmanager
async def stack(model: Path, tmp: Path):
    spec = ModelSpec.load(model)
    ctx = zmq.asyncio.Context()
    enc_addr = f"ipc://{tmp}/enc.sock"
    llm_addrs = [f"ipc://{tmp}/llm{i}.sock" for i in range(2)]
    encoder = EncoderService(EncoderConfig(model=str(model)), VisionTower(spec))
    llms = []
    for _ in llm_addrs:
        cfg = LLMConfig(model=str(model), num_kv_blocks=256)
        engine = Engine(cfg, spec)
        llms.append(LLMService(cfg, engine, MediaFetcher(ctx, 10.0, engine.lm.config.hidden_size)))
    servers = [RpcServer(ctx, enc_addr, encoder.handle, quick=encoder.quick)]
    servers += [RpcServer(ctx, a, s.handle, quick=s.quick) for a, s in zip(llm_addrs, llms, strict=True)]
    tasks = [asyncio.create_task(s.serve_forever()) for s in servers]
    cfg = ProcessorConfig(model=str(model), encoder=enc_addr, llm=llm_addrs[0])
    stages = StageClients(ctx, [enc_addr], llm_addrs)
    pipeline = Pipeline(
        cfg, MediaSource([], cfg.max_media_bytes, None), Preprocessor(cfg.model, 2.0, 64), PromptBuilder(spec)
    )
    try:
        yield pipeline, Dispatcher(stages, 30.0), stages, dict(zip(llm_addrs, llms, strict=True))
    finally:
        for t in tasks:
            t.cancel()
        stages.close()
        for s in servers:
            s.close()
        encoder.close()
        for s in llms:
            s.close()
        pipeline.close()
        ctx.destroy(linger=0)


def body(question: str) -> dict:
    return {
        "model": "m",
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "messages": [{"role": "user", "content": question}],
    }


async def answer(pipeline: Pipeline, dispatcher: Dispatcher, question: str) -> list[int]:
    prepared = await pipeline.prepare(parse_chat_request(body(question)))
    out: list[int] = []
    try:
        async for chunk in dispatcher.generate(prepared):
            out += chunk.token_ids
    finally:
        pipeline.done(prepared)
    return out


async def test_a_replica_whose_engine_failed_leaves_routing_and_its_requests_move(tiny_model, tmp_path):
    questions = [f"Question number {i}: what is the colour of the sea at dawn?" for i in range(6)]
    async with stack(tiny_model, tmp_path) as (pipeline, dispatcher, stages, llms):
        await stages.llm_set.ping_all()
        assert len(stages.llm_set.live()) == 2
        reference = [await answer(pipeline, dispatcher, q) for q in questions]
        # the replica that served them holds their common prefix (the chat template): routing
        # prefers it, so the requests below go to it first
        broken_address = max(llms, key=lambda a: llms[a].engine.num_steps)
        broken = llms[broken_address]
        broken.engine.faults.arm("schedule")
        retries = dispatcher.num_llm_retries
        # Concurrent requests: those routed to the broken replica end there with stage_unavailable
        # and move; every one is answered, with the same tokens.
        again = await asyncio.gather(*(answer(pipeline, dispatcher, f"x {q}") for q in questions))
        fresh = [await answer(pipeline, dispatcher, f"x {q}") for q in questions]
        assert again == fresh and all(len(t) == 8 for t in again)
        assert not broken.healthy and broken.engine.num_step_failures == 0  # not a model failure
        assert dispatcher.num_llm_retries > retries  # at least one request moved
        # out of routing after one heartbeat round (the dispatcher asked for one at once)
        await stages.llm_set.ping_all()
        assert [r.address for r in stages.llm_set.live()] == [a for a in llms if a != broken_address]
        healthy = llms[stages.llm_set.live()[0].address]
        steps = healthy.engine.num_steps
        assert [await answer(pipeline, dispatcher, q) for q in questions] == reference
        assert healthy.engine.num_steps > steps  # the healthy one served them
