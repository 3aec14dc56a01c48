"""The LLM stage process: generate requests in, token streams out, over ZeroMQ."""

from __future__ import annotations

import asyncio
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq.asyncio

from llm_stage.engine import Engine
from llm_stage.positions import mrope_positions
from llm_stage.scheduler import StepOutput
from llm_stage.sequence import MediaRows, Sequence
from llm_stage.validate import RequestError, validate
from shared.block_hash import root_hash
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
from shared.messages import Abort, ErrorReply, GenerateChunk, GenerateRequest, Ping, Pong
from shared.rpc import Responder
from shared.service import serve, setup_logging

log = logging.getLogger(__name__)


class LLMService:
    def __init__(self, cfg: LLMConfig, engine: Engine):
        self.cfg = cfg
        self.engine = engine
        self.spec = engine.spec
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue[StepOutput]] = {}
        self._by_request: dict[tuple[bytes, int], int] = {}
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._loop_task: asyncio.Task | None = None

    async def handle(self, msg: Any, reply: Responder) -> None:
        if isinstance(msg, GenerateRequest):
            await self._generate(msg, reply)
        elif isinstance(msg, Abort):
            seq_id = self._by_request.get((reply.identity, msg.request_id))
            if seq_id is not None:
                self.engine.cancel(seq_id)
                self._wakeup.set()
        elif isinstance(msg, Ping):
            await reply.send(self.pong())
        else:
            await reply.send(
                ErrorReply("bad_message", f"llm stage does not handle {type(msg).__name__}", 400)
            )

    def pong(self) -> Pong:
        stats = self.engine.blocks.stats
        return Pong(
            stage="llm",
            model=self.spec.name,
            fingerprint=self.spec.weights_fingerprint,
            load=self.engine.load,
            info={
                "max_model_len": self.engine.max_model_len,
                "block_size": self.cfg.block_size,
                "prefix_cache": self.cfg.prefix_cache,
                "prefix_queries": stats.queries,
                "prefix_hits": stats.hits,
                "evictions": stats.evictions,
                "preemptions": self.engine.scheduler.num_preemptions,
                "steps": self.engine.num_steps,
            },
        )

    def _sequence(self, msg: GenerateRequest) -> Sequence:
        token_ids = msg.prompt_token_ids.tolist()
        positions, delta = mrope_positions(len(token_ids), msg.spans, self.spec.tokens_per_second)
        media: list[MediaRows] = []
        embeddings = iter(msg.embeddings)
        for span in sorted(msg.spans, key=lambda s: s.offset):
            for i in range(len(span.chunk_keys)):
                media.append(MediaRows(span.offset + i * span.tokens_per_chunk, next(embeddings)))
        sp = msg.sampling
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.spec.eos_token_ids))
        max_tokens = min(sp.max_tokens, self.engine.max_model_len - len(token_ids))
        return Sequence(
            seq_id=next(self._ids),
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            positions=positions,
            rope_delta=delta,
            media=media,
            spans=list(msg.spans),
            root_hash=root_hash(self.spec.weights_fingerprint, msg.salt),
            sampling=sp if max_tokens == sp.max_tokens else _with_max_tokens(sp, max_tokens),
            max_model_len=self.engine.max_model_len,
            stop_ids=frozenset(stop),
        )

    async def _generate(self, msg: GenerateRequest, reply: Responder) -> None:
        try:
            validate(msg, self.spec, self.engine.lm, self.engine.max_model_len)
        except RequestError as exc:
            await reply.send(ErrorReply(exc.code, str(exc), 400))
            return
        if self.engine.load >= self.cfg.max_queue:
            await reply.send(ErrorReply("overloaded", "LLM stage queue is full, retry later", 503))
            return
        seq = self._sequence(msg)
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        self._streams[seq.seq_id] = queue
        key = (reply.identity, reply.rid)
        self._by_request[key] = seq.seq_id
        self._ensure_loop()
        self.engine.submit(seq)
        self._wakeup.set()
        try:
            while True:
                outs = [await queue.get()]
                while not queue.empty():
                    outs.append(queue.get_nowait())
                tokens = [o.token_id for o in outs if o.token_id is not None]
                last = outs[-1]
                chunk = GenerateChunk(
                    tokens, last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens
                )
                if last.finish_reason == "error":
                    await reply.send(ErrorReply("engine_error", "generation failed in the LLM stage", 500))
                    return
                await reply.send(chunk, final=last.finish_reason is not None)
                if last.finish_reason is not None:
                    return
        finally:
            self._streams.pop(seq.seq_id, None)
            self._by_request.pop(key, None)

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                await self._wakeup.wait()
                self._wakeup.clear()
                continue
            outputs = await loop.run_in_executor(self._executor, self.engine.step)
            for out in outputs:
                queue = self._streams.get(out.seq_id)
                if queue is not None:
                    queue.put_nowait(out)

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _with_max_tokens(sp, max_tokens: int):
    from dataclasses import replace

    return replace(sp, max_tokens=max_tokens)


def run(cfg: LLMConfig) -> None:
    setup_logging("llm")
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.asyncio.Context):
        service = LLMService(cfg, Engine(cfg, spec))
        return service.handle, service.close

    asyncio.run(serve("llm", cfg.bind, make))
