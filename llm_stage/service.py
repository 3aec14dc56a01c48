"""The LLM stage process: probe and generate requests in, token streams out, over ZeroMQ."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq.asyncio

from llm_stage.engine import Engine
from llm_stage.media_fetch import ChunkRef, MediaFetcher, MissingEmbeddings, chunk_refs
from llm_stage.positions import mrope_positions
from llm_stage.scheduler import StepOutput
from llm_stage.sequence import Sequence
from llm_stage.validate import RequestError, validate, validate_probe
from shared.block_hash import block_hashes, root_hash
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
from shared.messages import (
    Abort,
    ErrorReply,
    GenerateChunk,
    GenerateRequest,
    NeedEncode,
    Ping,
    Pong,
    ProbeReply,
    ProbeRequest,
    ReleaseHandoff,
    ReleaseProbe,
)
from shared.rpc import RemoteError, Responder
from shared.service import replica_id, run_stage

log = logging.getLogger(__name__)


class LLMService:
    def __init__(self, cfg: LLMConfig, engine: Engine, fetcher: MediaFetcher):
        self.cfg = cfg
        self.engine = engine
        self.fetcher = fetcher
        self.spec = engine.spec
        self._ids = itertools.count(1)
        self._streams: dict[int, asyncio.Queue[StepOutput]] = {}
        self._refs: dict[int, list[ChunkRef]] = {}
        self._by_request: dict[tuple[bytes, int], int] = {}
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._loop_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()

    def quick(self, msg: Any, reply: Responder) -> bool:
        """Everything but generation is answered as it arrives, without a task."""
        if isinstance(msg, ProbeRequest):
            self._probe(msg, reply)
        elif isinstance(msg, ReleaseProbe):
            self.engine.release_probe(msg.probe_id)
        elif isinstance(msg, Abort):
            seq_id = self._by_request.get((reply.identity, msg.request_id))
            if seq_id is not None:
                self.engine.cancel(seq_id)
                self._wakeup.set()
        elif isinstance(msg, Ping):
            reply.send_nowait(self.pong())
        else:
            return False  # to :meth:`handle`
        return True

    async def handle(self, msg: Any, reply: Responder) -> None:
        if isinstance(msg, GenerateRequest):
            await self._generate(msg, reply)
        else:
            await reply.send(
                ErrorReply("bad_message", f"llm stage does not handle {type(msg).__name__}", 400)
            )

    def pong(self) -> Pong:
        stats, fetch = self.engine.blocks.stats, self.fetcher.stats
        info = {
            "max_model_len": self.engine.max_model_len,
            "block_size": self.cfg.block_size,
            "prefix_cache": int(self.cfg.prefix_cache),
            "prefix_queries": stats.queries,
            "prefix_hits": stats.hits,
            "evictions": stats.evictions,
            "preemptions": self.engine.scheduler.num_preemptions,
            "steps": self.engine.num_steps,
            "free_blocks": self.engine.blocks.num_free_blocks,
            "embedding_fetches": fetch.fetches,
            "embedding_rows_fetched": fetch.rows,
            "chunks_skipped": fetch.chunks_skipped,
        }
        return Pong(
            "llm", self.spec.name, self.spec.weights_fingerprint, self.engine.load, info, id=replica_id()
        )

    # --- probe ----------------------------------------------------------------------------

    def _probe(self, msg: ProbeRequest, reply: Responder) -> None:
        try:
            validate_probe(msg, self.spec, self.engine.lm)
        except RequestError as exc:
            reply.send_nowait(ErrorReply(exc.code, str(exc), 400))
            return
        cached, probe_id = 0, 0
        if self.cfg.prefix_cache:
            ids = msg.prompt_token_ids.tolist()
            hashes = msg.block_hashes
            if msg.block_size != self.cfg.block_size or len(hashes) != len(ids) // self.cfg.block_size:
                root = root_hash(self.spec.weights_fingerprint, msg.salt)
                hashes = block_hashes(msg.prompt_token_ids, msg.spans, self.cfg.block_size, root)
            # NOTE: hashes from the processor only steer the probe; a hit is confirmed by tokens and
            # the request's own prefix is matched with hashes this stage computes itself.
            cached, probe_id = self.engine.probe(hashes, ids, msg.spans, min(msg.ttl, 60.0))
        reply.send_nowait(ProbeReply(cached, probe_id, self.engine.load, self.engine.max_model_len))

    # --- generate -------------------------------------------------------------------------

    def _sequence(self, msg: GenerateRequest) -> Sequence:
        token_ids = msg.prompt_token_ids.tolist()
        root = root_hash(self.spec.weights_fingerprint, msg.salt)
        positions, delta = mrope_positions(len(token_ids), msg.spans, self.spec.tokens_per_second)
        sp = msg.sampling
        stop = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.spec.eos_token_ids))
        max_tokens = min(sp.max_tokens, self.engine.max_model_len - len(token_ids))
        return Sequence(
            seq_id=next(self._ids),
            token_ids=token_ids,
            num_prompt_tokens=len(token_ids),
            positions=positions,
            rope_delta=delta,
            media=[],
            spans=list(msg.spans),
            root_hash=root,
            sampling=dataclasses.replace(sp, max_tokens=max_tokens),
            max_model_len=self.engine.max_model_len,
            stop_ids=frozenset(stop),
            # NOTE: hashed from the tensor now; later blocks (generated tokens) incrementally.
            block_hashes=block_hashes(msg.prompt_token_ids, msg.spans, self.cfg.block_size, root)
            if self.cfg.prefix_cache
            else [],
        )

    async def _prepare(self, msg: GenerateRequest, seq: Sequence, refs: list[ChunkRef]) -> list[bytes]:
        """Hold the cached prefix, then pull the media rows after it. Returns keys that are gone."""
        cached = self.engine.hold_prefix(seq)
        if msg.probe_id:
            self.engine.release_probe(msg.probe_id)
        skipped = [r for r in refs if r.end <= cached and r.handoff]
        for source in {r.source for r in skipped}:
            keys = [r.key for r in skipped if r.source == source]
            await self.fetcher.client(source).notify(ReleaseHandoff(keys))
        try:
            seq.media = await self.fetcher.fetch(seq, refs, cached, seq.num_prompt_tokens)
        except MissingEmbeddings as exc:
            self.engine.drop(seq)
            return exc.keys
        seq.rows_floor = cached
        return []

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
        refs = chunk_refs(msg.spans, msg.sources, msg.handoff)
        try:
            missing = await self._prepare(msg, seq, refs)
        except (RemoteError, TimeoutError, RuntimeError) as exc:
            self.engine.drop(seq)
            await reply.send(ErrorReply("encoder_unavailable", f"fetching embeddings failed: {exc}", 503))
            return
        except BaseException:
            self.engine.drop(seq)
            raise
        if missing:
            await reply.send(NeedEncode(missing))
            return
        await self._stream(seq, refs, reply, msg.stream)

    async def _stream(self, seq: Sequence, refs: list[ChunkRef], reply: Responder, stream: bool) -> None:
        queue: asyncio.Queue[StepOutput] = asyncio.Queue()
        key = (reply.identity, reply.rid)
        self._streams[seq.seq_id] = queue
        self._refs[seq.seq_id] = refs
        self._by_request[key] = seq.seq_id
        self._ensure_loop()
        self.engine.submit(seq)
        self._wakeup.set()
        tokens: list[int] = []
        last = None
        try:
            while True:
                outs = [await queue.get()]
                while not queue.empty():
                    outs.append(queue.get_nowait())
                last = outs[-1]
                if last.finish_reason == "error":
                    await reply.send(ErrorReply("engine_error", last.error or "generation failed", 500))
                    return
                tokens += [o.token_id for o in outs if o.token_id is not None]
                if not stream and last.finish_reason is None:
                    continue  # one message at the end instead of one per step
                chunk = GenerateChunk(
                    tokens, last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens
                )
                await reply.send(chunk, final=last.finish_reason is not None)
                if last.finish_reason is not None:
                    return
                tokens = []
        finally:
            self._streams.pop(seq.seq_id, None)
            self._refs.pop(seq.seq_id, None)
            self._by_request.pop(key, None)
            if last is None or last.finish_reason is None:  # the caller is gone or we are stopping
                self.engine.cancel(seq.seq_id)
                self._wakeup.set()

    # --- the engine loop ----------------------------------------------------------------

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
            for seq in self.engine.take_starving():
                task = loop.create_task(self._refetch(seq))
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _refetch(self, seq: Sequence) -> None:
        """A preempted sequence lost part of its cached prefix: fetch every media row it skipped."""
        try:
            rows = await self.fetcher.fetch(seq, self._refs.get(seq.seq_id, []), 0, seq.rows_floor)
        except Exception as exc:
            log.warning("sequence %d cannot resume: %s", seq.seq_id, exc)
            self.engine.fail(seq, f"media rows vanished while the request was preempted: {exc}")
        else:
            seq.media = rows + seq.media
            seq.rows_floor = 0
            self.engine.submit(seq)
        self._wakeup.set()

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.fetcher.close()


def run(cfg: LLMConfig) -> None:
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.asyncio.Context):
        engine = Engine(cfg, spec)
        fetcher = MediaFetcher(ctx, cfg.fetch_timeout, engine.lm.config.hidden_size)
        service = LLMService(cfg, engine, fetcher)
        return service.handle, service.quick, service.close

    run_stage("llm", cfg.bind, cfg.torch_threads, make)
