"""The LLM stage process: probe and generate requests in, token streams out, over ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import zmq

from llm_stage.engine import Engine
from llm_stage.grammar import GrammarCache, GrammarError
from llm_stage.kv_cache import KVCache
from llm_stage.kv_tier import KVWanted
from llm_stage.live import LiveRequest, send_replies
from llm_stage.media_fetch import MediaFetcher, chunk_refs
from llm_stage.media_rows import RowSupply
from llm_stage.metrics import LLMMetrics
from llm_stage.scheduler import StepOutput
from llm_stage.sequence import SeqStatus, Sequence
from llm_stage.validate import RequestError, validate, validate_probe
from shared.block_hash import BlockHash, block_hashes, root_hash
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
from shared.keys import ChunkKey
from shared.kv_block_codec import StoredBlock
from shared.messages import (
    Abort,
    ErrorReply,
    GenerateRequest,
    MediaSpan,
    Ping,
    Pong,
    ProbeReply,
    ProbeRequest,
    Reencoded,
    ReleaseProbe,
)
from shared.metrics import MetricsServer
from shared.rpc import Responder
from shared.service import replica_id, run_stage, with_metrics_server

log = logging.getLogger(__name__)

# stats() keys read from the KV tier's counters (``kv_store_<KVTierStats field>``)
KV_TIER_COUNTERS = (
    "kv_store_lookups",
    "kv_store_skipped",
    "kv_store_hit_blocks",
    "kv_store_miss_blocks",
    "kv_store_loaded_blocks",
    "kv_store_bytes_in",
    "kv_store_bytes_out",
    "kv_store_written_blocks",
    "kv_store_dropped_blocks",
)
IDLE_POLL_SECONDS = 0.05  # how long a step that could run nothing waits for news before trying again


class LLMService:
    def __init__(self, cfg: LLMConfig, engine: Engine, fetcher: MediaFetcher):
        self.cfg = cfg
        self.engine = engine
        self.fetcher = fetcher
        self.spec = engine.spec
        self.grammars = GrammarCache(self.spec.path, engine.lm.vocab_size, list(self.spec.eos_token_ids))
        self._ids = itertools.count(1)
        self._live: dict[int, LiveRequest] = {}  # seq id → request
        self._by_request: dict[tuple[bytes, int], LiveRequest] = {}  # (peer, request id) → request
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._loop_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self._block_bytes = KVCache.bytes_per_block(engine.lm, cfg.block_size, engine.dtype)
        self.metrics = LLMMetrics(self.stats)
        self.metrics_server: MetricsServer | None = None
        self.rows = RowSupply(cfg, engine, fetcher, self.metrics, self._spawn, self._wakeup)
        if engine.kv_tier is not None:
            engine.kv_tier.on_latency = self.metrics.kv_store_latency.observe

    def quick(self, msg: Any, reply: Responder) -> bool:
        """Everything but generation is answered as it arrives, without a task."""
        if isinstance(msg, ProbeRequest):
            self._probe(msg, reply)
        elif isinstance(msg, ReleaseProbe):
            self.engine.release_probe(msg.probe_id)
        elif isinstance(msg, Abort):
            live = self._by_request.get((reply.identity, msg.request_id))
            if live is not None:
                self.engine.cancel(live.seq)
                self._wakeup.set()
        elif isinstance(msg, Reencoded):
            live = self._by_request.get((reply.identity, msg.request_id))
            if live is not None and live.reencoded is not None and not live.reencoded.done():
                live.reencoded.set_result(msg)
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

    def stats(self) -> dict[str, int | float]:
        """This replica's numbers (read by the metrics thread: ints and lengths only)."""
        blocks, fetch, scheduler = self.engine.blocks, self.fetcher.stats, self.engine.scheduler
        total = len(blocks.blocks)
        used = total - blocks.num_free_blocks
        running = sum(1 for seq in scheduler.running if seq.status is SeqStatus.RUNNING)
        return {
            "prefix_queries": blocks.stats.queries,
            "prefix_hits": blocks.stats.hits,
            "evictions": blocks.stats.evictions,
            "preemptions": scheduler.num_preemptions,
            "steps": self.engine.num_steps,
            "free_blocks": total - used,
            "used_blocks": used,
            "kv_usage": used / total if total else 0.0,
            "kv_bytes": used * self._block_bytes,
            "kv_capacity_bytes": total * self._block_bytes,
            "running": running,
            "waiting": len(scheduler.waiting) + len(scheduler.running) - running,
            "embedding_fetches": fetch.fetches,
            "embedding_rows_fetched": fetch.rows,
            "embedding_feature_rows_fetched": fetch.feature_rows,
            "chunks_skipped": fetch.chunks_skipped,
            "grammar_compiles": self.grammars.stats.compiles,
            "grammar_cache_hits": self.grammars.stats.hits,
            **self.engine.memory_info(),
            **self._kv_tier_stats(),
        }

    def _kv_tier_stats(self) -> dict[str, Any]:
        tier = self.engine.kv_tier
        if tier is None:
            return (
                {"kv_store_enabled": 0, "kv_store_up": 0}
                | dict.fromkeys(KV_TIER_COUNTERS, 0)
                | {"kv_store_errors": {}}
            )
        stats = tier.stats
        return {
            "kv_store_enabled": 1,
            "kv_store_up": int(tier.store.up),
            **{key: getattr(stats, key.removeprefix("kv_store_")) for key in KV_TIER_COUNTERS},
            "kv_store_errors": dict(stats.errors),
        }

    def pong(self) -> Pong:
        info = {
            "max_model_len": self.engine.max_model_len,
            "prefix_cache": int(self.cfg.prefix_cache),
            **self.stats(),
            **{f"repairs_{cause}": n for cause, n in sorted(self.rows.repairs.items())},
        }
        if self.metrics_server is not None and self.metrics_server.port is not None:
            info["metrics_port"] = self.metrics_server.port
        return Pong(
            "llm",
            self.spec.name,
            self.spec.weights_fingerprint,
            self.engine.load,
            info,
            self.cfg.block_size,
            id=replica_id(),
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
            size = self.cfg.block_size
            limit = (len(ids) - 1) // size  # full blocks, the last token always computed
            if self.engine.kv_tier is not None and cached // size < limit:  # KV tier hook
                wanted = hashes[cached // size : limit]
                self._spawn(self._probe_store(reply, cached, probe_id, cached // size, wanted))
                return
        reply.send_nowait(ProbeReply(cached, probe_id, self.engine.load, self.engine.max_model_len))

    async def _probe_store(
        self, reply: Responder, cached: int, probe_id: int, first: int, hashes: list[BlockHash]
    ) -> None:
        """Answer a probe with the prefix the shared KV store adds past the local one."""
        stored = 0
        try:
            assert self.engine.kv_tier is not None
            n = await self.engine.kv_tier.stored(hashes)
            stored = (first + n) * self.cfg.block_size if n else 0
        finally:
            reply.send_nowait(
                ProbeReply(cached, probe_id, self.engine.load, self.engine.max_model_len, stored)
            )

    # --- generate -------------------------------------------------------------------------

    def _sequence(self, msg: GenerateRequest) -> Sequence:
        """The request's sequence; a moved generation's tokens so far follow its prompt as output
        (penalties, min_tokens, max_tokens and the seeded draws count them), computed like a
        preempted sequence's."""
        sp = msg.sampling
        seq = Sequence.new(
            seq_id=next(self._ids),
            prompt=msg.prompt_token_ids,
            spans=list(msg.spans),
            root_hash=root_hash(self.spec.weights_fingerprint, msg.salt),
            sampling=dataclasses.replace(
                sp, max_tokens=min(sp.max_tokens, self.engine.max_model_len - msg.prompt_token_ids.numel())
            ),
            max_model_len=self.engine.max_model_len,
            eos_token_ids=self.spec.eos_token_ids,
            tokens_per_second=self.spec.tokens_per_second,
            block_size=self.cfg.block_size if self.cfg.prefix_cache else 0,
            probe_id=msg.probe_id,
        )
        seq.token_ids.extend(msg.resume_token_ids)
        return seq

    async def _generate(self, msg: GenerateRequest, reply: Responder) -> None:
        arrived = time.perf_counter()
        try:
            validate(msg, self.spec, self.engine.lm, self.engine.max_model_len)
        except RequestError as exc:
            await self._fail(reply, ErrorReply(exc.code, str(exc), 400))
            return
        if self.engine.load >= self.cfg.max_queue:
            if msg.probe_id:
                self.engine.release_probe(msg.probe_id)
            await self._fail(reply, ErrorReply("overloaded", "LLM stage queue is full, retry later", 503))
            return
        seq = self._sequence(msg)
        if msg.sampling.grammar is not None:
            # NOTE: compiled here, before the sequence is submitted: the engine's steps never wait on it.
            try:
                seq.matcher = await self.grammars.matcher(msg.sampling.grammar)
                for token in msg.resume_token_ids:  # a moved generation: its grammar state so far
                    if not seq.matcher.consume_token(token):
                        raise GrammarError("the resumed tokens do not follow it")
            except GrammarError as exc:
                if msg.probe_id:
                    self.engine.release_probe(msg.probe_id)
                error = ErrorReply("bad_grammar", f"the grammar does not compile: {exc}", 400)
                await self._fail(reply, error)
                return
        pinned = {key for key, held in zip(_keys(msg.spans), msg.handoff, strict=True) if held}
        live = LiveRequest(seq, reply, chunk_refs(msg.spans, msg.sources), pinned)
        key = (reply.identity, reply.rid)
        self._live[seq.seq_id] = live
        self._by_request[key] = live
        try:
            self._ensure_loop()
            self.metrics.track(seq, arrived)
            self.engine.submit(seq)
            self._wakeup.set()
            ended = await send_replies(live, msg.stream)
            if ended is not None:
                await self._fail(reply, ended)
        finally:
            self.metrics.forget(seq.seq_id)
            self._live.pop(seq.seq_id, None)
            self._by_request.pop(key, None)
            for task in live.tasks:
                task.cancel()
            if seq.finish_reason is None:  # the caller is gone or we are stopping
                self.engine.cancel(seq)
                self._wakeup.set()
            if live.pinned:
                self.rows.release_pins(live, list(live.pinned))

    async def _fail(self, reply: Responder, error: ErrorReply) -> None:
        """End a generate request with ``error`` (counted by status and code)."""
        self.metrics.errored(error)
        await reply.send(error)

    # --- the engine loop ----------------------------------------------------------------

    def _ensure_loop(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.get_running_loop().create_task(self._engine_loop())

    async def _engine_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.engine.has_work():
                await self._wakeup.wait()
            self._wakeup.clear()  # NOTE: before the step, so nothing sent during it is missed
            started = time.perf_counter()
            try:
                result = await loop.run_in_executor(self._executor, self.engine.step)
            except Exception:
                # NOTE: a bug, not a request's fault: end every request now rather than let its
                # caller wait for the stage timeout.
                log.exception("engine step failed; ending %d request(s)", len(self._live))
                for each in self._live.values():
                    each.queue.put_nowait(StepOutput(each.seq.seq_id, None, "error", 0, 0, "engine failure"))
                raise
            self.metrics.step(started, time.perf_counter(), result.outputs)
            for out in result.outputs:
                live = self._live.get(out.seq_id)
                if live is not None:
                    live.queue.put_nowait(out)
            for seq in result.admitted:
                if (live := self._live.get(seq.seq_id)) is not None:
                    self.rows.admitted(live)
            for kv_wanted in result.kv_fetches:  # KV tier hook: read a prefix from the shared store
                self._spawn(self._read_kv(kv_wanted))
            for wanted in result.fetches:
                live = self._live.get(wanted.seq.seq_id)
                if live is not None:
                    live.tasks.add(task := self._spawn(self.rows.fetch(live, wanted.ranges)))
                    task.add_done_callback(live.tasks.discard)
                else:  # its caller is gone: the engine must not wait for rows nobody fetches
                    self.engine.fail(wanted.seq, "the request's caller is gone")
            if not result.computed and not result.outputs:
                # Every admitted sequence waits for rows and none can be admitted: sleep until a
                # command arrives (rows, a request, a cancel), or a probe's pin may have expired.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_POLL_SECONDS):
                        await self._wakeup.wait()

    async def _read_kv(self, wanted: KVWanted) -> None:
        """Read ``wanted`` from the KV tier; the sequence goes on (with what came) in any case."""
        blocks: list[StoredBlock] = []
        try:
            if self.engine.kv_tier is not None:
                blocks = await self.engine.kv_tier.fetch(wanted.hashes)
        finally:
            self.engine.add_kv(wanted.seq, wanted.first, blocks)
            self._wakeup.set()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    def close(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.grammars.close()
        self.fetcher.close()
        if self.engine.kv_tier is not None:
            self.engine.kv_tier.close()


def _keys(spans: list[MediaSpan]) -> list[ChunkKey]:
    return [key for span in spans for key in span.chunk_keys]


def run(cfg: LLMConfig) -> None:
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.Context):
        engine = Engine(cfg, spec)
        fetcher = MediaFetcher(ctx, cfg.fetch_timeout, engine.lm.config.hidden_size, spec.feature_sets)
        return await with_metrics_server(LLMService(cfg, engine, fetcher), cfg.metrics_port)

    run_stage("llm", cfg.bind, cfg.torch_threads, make, cfg.log_format)
