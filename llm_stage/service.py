"""The LLM stage process: probe and generate requests in, token streams out, over ZeroMQ."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import zmq

from llm_stage.engine import Engine
from llm_stage.grammar import GrammarCache, GrammarError
from llm_stage.kv_cache import KVCache
from llm_stage.media_fetch import ChunkRef, MediaFetcher, chunk_refs
from llm_stage.metrics import LLMMetrics
from llm_stage.scheduler import StepOutput
from llm_stage.sequence import SeqStatus, Sequence
from llm_stage.validate import RequestError, validate, validate_probe
from shared.block_hash import block_hashes, root_hash
from shared.checkpoint import ModelSpec
from shared.config import LLMConfig
from shared.messages import (
    Abort,
    ErrorReply,
    GenerateChunk,
    GenerateRequest,
    MediaSpan,
    NeedEncode,
    Ping,
    Pong,
    ProbeReply,
    ProbeRequest,
    Reencoded,
    ReleaseHandoff,
    ReleaseProbe,
    TokenLogprobs,
)
from shared.metrics import MetricsServer
from shared.rpc import Responder
from shared.service import replica_id, run_stage

log = logging.getLogger(__name__)

IDLE_POLL_SECONDS = 0.05  # how long a step that could run nothing waits for news before trying again
# NOTE: a request nobody reads token by token still reports its tokens every so often, so that if
# this replica dies the processor moves it with its tokens so far instead of starting it again.
PROGRESS_EVERY = 16


@dataclass(slots=True, eq=False)
class _Live:
    """A generate request the stage is serving."""

    seq: Sequence
    reply: Responder
    refs: list[ChunkRef]
    pinned: set[bytes]  # chunks this request holds a hand-off pin for at their encoders
    queue: asyncio.Queue[StepOutput] = field(default_factory=asyncio.Queue)
    tasks: set[asyncio.Task] = field(default_factory=set)
    repairs: int = 0
    reencoded: asyncio.Future[Reencoded] | None = None  # while the processor re-encodes for it
    failure: ErrorReply | None = None  # why it ended with an error, when that was not the engine


class LLMService:
    def __init__(self, cfg: LLMConfig, engine: Engine, fetcher: MediaFetcher):
        self.cfg = cfg
        self.engine = engine
        self.fetcher = fetcher
        self.spec = engine.spec
        self.grammars = GrammarCache(self.spec.path, engine.lm.vocab_size, list(self.spec.eos_token_ids))
        self._ids = itertools.count(1)
        self._live: dict[int, _Live] = {}  # seq id → request
        self._by_request: dict[tuple[bytes, int], _Live] = {}  # (peer, request id) → request
        self._wakeup = asyncio.Event()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._loop_task: asyncio.Task | None = None
        self._background: set[asyncio.Task] = set()
        self.repairs: Counter[str] = Counter()  # mid-request repairs, by cause (any chunk unreachable)
        self._block_bytes = KVCache.bytes_per_block(engine.lm, cfg.block_size, engine.dtype)
        self.metrics = LLMMetrics(self.stats)
        self.metrics_server: MetricsServer | None = None

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
        }

    def pong(self) -> Pong:
        info = {
            "max_model_len": self.engine.max_model_len,
            "prefix_cache": int(self.cfg.prefix_cache),
            **self.stats(),
            **{f"repairs_{cause}": n for cause, n in sorted(self.repairs.items())},
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
        reply.send_nowait(ProbeReply(cached, probe_id, self.engine.load, self.engine.max_model_len))

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
            await reply.send(ErrorReply(exc.code, str(exc), 400))
            return
        if self.engine.load >= self.cfg.max_queue:
            if msg.probe_id:
                self.engine.release_probe(msg.probe_id)
            await reply.send(ErrorReply("overloaded", "LLM stage queue is full, retry later", 503))
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
                await reply.send(ErrorReply("bad_grammar", f"the grammar does not compile: {exc}", 400))
                return
        pinned = {key for key, held in zip(_keys(msg.spans), msg.handoff, strict=True) if held}
        live = _Live(seq, reply, chunk_refs(msg.spans, msg.sources), pinned)
        key = (reply.identity, reply.rid)
        self._live[seq.seq_id] = live
        self._by_request[key] = live
        try:
            self._ensure_loop()
            self.metrics.track(seq, arrived)
            self.engine.submit(seq)
            self._wakeup.set()
            await self._stream(live, msg.stream)
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
                self._release_pins(live, list(live.pinned))

    async def _stream(self, live: _Live, stream: bool) -> None:
        tokens: list[int] = []
        logprobs: list[TokenLogprobs] = []
        prompt: list[TokenLogprobs | None] | None = None
        while True:
            outs = [await live.queue.get()]
            while not live.queue.empty():
                outs.append(live.queue.get_nowait())
            last = outs[-1]
            if last.finish_reason == "error":
                error = live.failure or ErrorReply("engine_error", last.error or "generation failed", 500)
                await live.reply.send(error)
                return
            tokens += [o.token_id for o in outs if o.token_id is not None]
            logprobs += [o.logprobs for o in outs if o.logprobs is not None]
            prompt = next((o.prompt_logprobs for o in outs if o.prompt_logprobs is not None), prompt)
            if not stream and last.finish_reason is None and len(tokens) < PROGRESS_EVERY:
                continue  # a message per PROGRESS_EVERY tokens instead of one per step
            chunk = GenerateChunk(
                tokens, last.finish_reason, last.num_prompt_tokens, last.num_cached_tokens, logprobs, prompt
            )
            await live.reply.send(chunk, final=last.finish_reason is not None)
            if last.finish_reason is not None:
                return
            tokens, logprobs, prompt = [], [], None

    # --- media rows -----------------------------------------------------------------------

    def _admitted(self, seq: Sequence) -> None:
        """``seq``'s cached prefix is known: chunks wholly inside it need no rows, let their pins go."""
        live = self._live.get(seq.seq_id)
        if live is None:
            return
        skipped = [r for r in live.refs if r.end <= seq.num_cached_tokens]
        self.fetcher.stats.chunks_skipped += len(skipped)
        self._release_pins(live, [r.key for r in skipped if r.key in live.pinned])

    def _release_pins(self, live: _Live, keys: list[bytes]) -> None:
        by_source: dict[str, list[bytes]] = {}
        for r in live.refs:
            if r.key in keys and r.key in live.pinned:
                by_source.setdefault(r.source, []).append(r.key)
        live.pinned.difference_update(keys)
        for source, group in by_source.items():
            self._spawn(self.fetcher.client(source).notify(ReleaseHandoff(list(dict.fromkeys(group)))))

    async def _fetch(self, live: _Live, ranges: list[tuple[int, int]]) -> None:
        """Fetch the rows ``live`` lacks; rows gone at their encoders are re-encoded by the
        processor on the live request (a repair), at most ``--max-repairs`` times."""
        seq, rows, todo = live.seq, [], ranges
        started = time.perf_counter()
        try:
            while True:
                result = await self.fetcher.fetch(live.refs, todo, live.pinned)
                rows += result.rows
                if not result.lost:
                    break
                if not await self._repair(live, result.lost):
                    return
                todo = [
                    (max(lo, r.start), min(hi, r.end))
                    for lo, hi in ranges
                    for r in live.refs
                    if r.key in result.lost and r.end > lo and r.start < hi
                ]
            self.metrics.fetched(time.perf_counter() - started)
            self.engine.add_rows(seq, rows)
        except Exception as exc:
            log.exception("fetching media rows for sequence %d failed", seq.seq_id)
            live.failure = ErrorReply("media_unavailable", f"media rows could not be fetched: {exc}", 503)
            self.engine.fail(seq, str(exc))
        finally:
            self._wakeup.set()

    async def _repair(self, live: _Live, lost: dict[bytes, str]) -> bool:
        """Ask the processor to encode ``lost`` chunks again and wait for it; False if it ended."""
        causes = Counter(lost.values())
        if live.repairs >= self.cfg.max_repairs:
            message = f"{len(lost)} chunk(s) kept vanishing from their encoders ({dict(causes)})"
            live.failure = ErrorReply("encoder_churn", message + "; retry later", 503)
            self.engine.fail(live.seq, message)
            return False
        live.repairs += 1
        cause = "unreachable" if "unreachable" in causes else "missing"
        self.repairs[cause] += 1
        self.metrics.repairs.labels(cause).inc()
        log.info("sequence %d: re-encoding %d chunk(s) (%s)", live.seq.seq_id, len(lost), dict(causes))
        live.reencoded = asyncio.get_running_loop().create_future()
        try:
            await live.reply.send(NeedEncode(list(lost), cause), final=False)
            async with asyncio.timeout(self.cfg.repair_timeout):
                done = await live.reencoded
        except TimeoutError:
            message = f"the processor did not re-encode {len(lost)} chunk(s) in {self.cfg.repair_timeout:g} s"
            live.failure = ErrorReply("repair_timeout", message, 503)
            self.engine.fail(live.seq, message)
            return False
        finally:
            live.reencoded = None
        if len(done.sources) == len(live.refs):
            live.refs = [
                dataclasses.replace(r, source=s) for r, s in zip(live.refs, done.sources, strict=True)
            ]
        live.pinned.update(done.keys)
        return True

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
                for live in self._live.values():
                    live.queue.put_nowait(StepOutput(live.seq.seq_id, None, "error", 0, 0, "engine failure"))
                raise
            self.metrics.step(started, time.perf_counter(), result.outputs)
            for out in result.outputs:
                live = self._live.get(out.seq_id)
                if live is not None:
                    live.queue.put_nowait(out)
            for seq in result.admitted:
                self._admitted(seq)
            for wanted in result.fetches:
                live = self._live.get(wanted.seq.seq_id)
                if live is not None:
                    live.tasks.add(task := self._spawn(self._fetch(live, wanted.ranges)))
                    task.add_done_callback(live.tasks.discard)
                else:  # its caller is gone: the engine must not wait for rows nobody fetches
                    self.engine.fail(wanted.seq, "the request's caller is gone")
            if not result.computed and not result.outputs:
                # Every admitted sequence waits for rows and none can be admitted: sleep until a
                # command arrives (rows, a request, a cancel), or a probe's pin may have expired.
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(IDLE_POLL_SECONDS):
                        await self._wakeup.wait()

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


def _keys(spans: list[MediaSpan]) -> list[bytes]:
    return [key for span in spans for key in span.chunk_keys]


def run(cfg: LLMConfig) -> None:
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.Context):
        engine = Engine(cfg, spec)
        fetcher = MediaFetcher(ctx, cfg.fetch_timeout, engine.lm.config.hidden_size, spec.feature_sets)
        service = LLMService(cfg, engine, fetcher)
        metrics = service.metrics_server = await MetricsServer.start(
            service.metrics.registry, cfg.metrics_port
        )

        async def close() -> None:
            service.close()
            await metrics.close()

        return service.handle, service.quick, close

    run_stage("llm", cfg.bind, cfg.torch_threads, make, cfg.log_format)
