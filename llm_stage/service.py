"""The LLM stage process: probe and generate requests in, token streams out, over ZeroMQ.

A generate request is registered the moment it arrives (its :class:`LiveRequest`
exists before the first ``await``), so an abort or its caller's going reaches it
whatever it waits for (its grammar, a slot, its media rows); everything it holds is
let go in one place (:meth:`LLMService._release`).

The engine loop is supervised: a step whose model call fails fails the requests it
computed and the loop goes on; any other failure means the engine can no longer be
trusted, so every live request ends (``stage_unavailable``: the processor moves it),
the replica answers its heartbeat as unhealthy (discovery drops it) and refuses
new requests. It never keeps answering while it no longer steps.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from typing import Any

import zmq

from mmcache.llm_stage.engine import Engine, StepResult
from mmcache.llm_stage.engine_loop import EngineLoop
from mmcache.llm_stage.grammar import GrammarCache, GrammarError
from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.kv_tier import KVWanted
from mmcache.llm_stage.live import LiveRequest, send_replies
from mmcache.llm_stage.media_fetch import MediaFetcher, chunk_refs
from mmcache.llm_stage.media_rows import RowSupply
from mmcache.llm_stage.metrics import LLMMetrics
from mmcache.llm_stage.replica_stats import replica_stats
from mmcache.llm_stage.scheduler import StepOutput
from mmcache.llm_stage.sequence import SeqStatus, Sequence
from mmcache.llm_stage.validate import RequestError, validate, validate_probe
from mmcache.shared.block_hash import BlockHash, block_hashes, root_hash
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.keys import ChunkKey
from mmcache.shared.kv_block_codec import StoredBlock
from mmcache.shared.messages import (
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
from mmcache.shared.metrics import MetricsServer
from mmcache.shared.rpc import Responder
from mmcache.shared.service import replica_id, run_stage, with_metrics_server

log = logging.getLogger(__name__)


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
        self._background: set[asyncio.Task] = set()
        self._block_bytes = KVCache.bytes_per_block(engine.lm, cfg.block_size, engine.dtype)
        self.metrics = LLMMetrics(self.stats)
        self.metrics_server: MetricsServer | None = None
        self.loop = EngineLoop(engine, self.metrics, self._deliver, self._distrusted)
        self._wakeup = self.loop.wakeup
        self.rows = RowSupply(cfg, engine, fetcher, self.metrics, self._spawn, self._wakeup)
        if engine.kv_tier is not None:
            engine.kv_tier.on_latency = self.metrics.kv_store_latency.observe

    @property
    def healthy(self) -> bool:
        """False once the engine can no longer be trusted (see :mod:`llm_stage.engine_loop`)."""
        return self.loop.healthy

    def quick(self, msg: Any, reply: Responder) -> bool:
        """Everything but generation is answered as it arrives, without a task."""
        if isinstance(msg, ProbeRequest):
            self._probe(msg, reply)
        elif isinstance(msg, ReleaseProbe):
            self._release_pin(msg.probe_id)
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
        fetch, grammars = self.fetcher.stats, self.grammars.stats
        return replica_stats(self.engine, fetch, grammars, self.healthy, self._block_bytes)

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
            healthy=self.healthy,
            max_model_len=self.engine.max_model_len,
        )

    # --- probe ----------------------------------------------------------------------------

    def _probe(self, msg: ProbeRequest, reply: Responder) -> None:
        if not self.healthy:
            reply.send_nowait(_unavailable())
            return
        try:
            validate_probe(msg, self.spec, self.engine.lm)
        except RequestError as exc:
            reply.send_nowait(ErrorReply(exc.code, str(exc), 400))
            return
        if not self.cfg.prefix_cache:
            reply.send_nowait(ProbeReply(0, 0, self.engine.load, self.engine.max_model_len))
        elif not self.loop.between_steps(lambda: self._match(msg, reply)):
            reply.send_nowait(ErrorReply("overloaded", "LLM stage has too many probes waiting", 503))

    def _match(self, msg: ProbeRequest, reply: Responder) -> None:
        """Answer a probe from the prefix cache (between steps), pinning what matched."""
        if not self.healthy:
            reply.send_nowait(_unavailable())
            return
        self.loop.start()  # NOTE: it lets the pin go at its expiry
        ids = msg.prompt_token_ids.tolist()
        hashes = msg.block_hashes
        if msg.block_size != self.cfg.block_size or len(hashes) != len(ids) // self.cfg.block_size:
            root = root_hash(self.spec.weights_fingerprint, msg.salt)
            hashes = block_hashes(msg.prompt_token_ids, msg.spans, self.cfg.block_size, root)
        # NOTE: hashes from the processor only steer the probe; a hit is confirmed by tokens and
        # the request's own prefix is matched with hashes this stage computes itself.
        cached, pin_id = self.engine.probe(hashes, ids, msg.spans, min(msg.ttl, 60.0))
        if pin_id:
            self._wakeup.set()  # the loop's timeout is the next pin's expiry
        size = self.cfg.block_size
        limit = (len(ids) - 1) // size  # full blocks, the last token always computed
        if self.engine.kv_tier is not None and cached // size < limit:  # KV tier hook
            wanted = hashes[cached // size : limit]
            self._spawn(self._probe_store(reply, cached, pin_id, cached // size, wanted))
            return
        reply.send_nowait(ProbeReply(cached, pin_id, self.engine.load, self.engine.max_model_len))

    def _release_pin(self, pin_id: int) -> None:
        """A probe's pin its request will not use (beyond the deferral bound: left to expire)."""
        if pin_id:
            self.loop.between_steps(lambda: self.engine.release_pin(pin_id))

    async def _probe_store(
        self, reply: Responder, cached: int, pin_id: int, first: int, hashes: list[BlockHash]
    ) -> None:
        """Answer a probe with the prefix the shared KV store adds past the local one."""
        stored = 0
        try:
            assert self.engine.kv_tier is not None
            n = await self.engine.kv_tier.stored(hashes)
            stored = (first + n) * self.cfg.block_size if n else 0
        finally:
            reply.send_nowait(ProbeReply(cached, pin_id, self.engine.load, self.engine.max_model_len, stored))

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
            pin_id=msg.probe_id,
        )
        seq.token_ids.extend(msg.resume_token_ids)
        if sp.grammar is not None:
            seq.status = SeqStatus.WAITING_FOR_GRAMMAR
        return seq

    def _refusal(self, msg: GenerateRequest) -> ErrorReply | None:
        """Why ``msg`` is refused before it becomes a sequence, if it is."""
        if not self.healthy:
            return _unavailable()
        try:
            validate(msg, self.spec, self.engine.lm, self.engine.max_model_len)
        except RequestError as exc:
            return ErrorReply(exc.code, str(exc), 400)
        if self.engine.load >= self.cfg.max_queue:
            return ErrorReply("overloaded", "LLM stage queue is full, retry later", 503)
        return None

    async def _generate(self, msg: GenerateRequest, reply: Responder) -> None:
        arrived = time.perf_counter()
        refused = self._refusal(msg)
        if refused is not None:
            self._release_pin(msg.probe_id)  # NOTE: at once: no sequence will let it go
            await self._fail(reply, refused)
            return
        live = self._register(msg, reply, arrived)
        try:
            ended = await send_replies(live, msg.stream)
            if ended is not None:
                await self._fail(reply, ended)
        finally:
            self._release(live, (reply.identity, reply.rid))

    def _register(self, msg: GenerateRequest, reply: Responder, arrived: float) -> LiveRequest:
        """The request's sequence, submitted, and its :class:`LiveRequest`, findable by an abort
        (no ``await`` here: nothing can come between its arrival and its registration)."""
        seq = self._sequence(msg)
        pinned = {key for key, held in zip(_keys(msg.spans), msg.handoff, strict=True) if held}
        live = LiveRequest(seq, reply, chunk_refs(msg.spans, msg.sources), pinned)
        self._live[seq.seq_id] = live
        self._by_request[(reply.identity, reply.rid)] = live
        self.loop.start()
        self.metrics.track(seq, arrived)
        self.engine.submit(seq)
        if msg.sampling.grammar is not None:
            compile_ = self._spawn(self._compile(live, msg.sampling.grammar, msg.resume_token_ids))
            live.tasks.add(compile_)
            compile_.add_done_callback(live.tasks.discard)
        self._wakeup.set()
        return live

    async def _compile(self, live: LiveRequest, grammar: str, resumed: list[int]) -> None:
        """Compile ``live``'s grammar (shared with concurrent requests for the same one) and hand
        its matcher to the engine; the sequence waits for it in ``WAITING_FOR_GRAMMAR``."""
        try:
            matcher = await self.grammars.matcher(grammar)
            for token in resumed:  # a moved generation: its grammar state so far
                if not matcher.consume_token(token):
                    raise GrammarError("the resumed tokens do not follow it")
        except GrammarError as exc:
            live.failure = ErrorReply("bad_grammar", f"the grammar does not compile: {exc}", 400)
            self.engine.fail(live.seq, str(exc))
        except Exception as exc:
            log.exception("compiling a grammar failed")
            live.failure = ErrorReply("grammar_failed", f"the grammar could not be compiled: {exc}", 500)
            self.engine.fail(live.seq, str(exc))
        else:
            self.engine.grammar_ready(live.seq, matcher)
        self._wakeup.set()

    def _release(self, live: LiveRequest, key: tuple[bytes, int]) -> None:
        """The one place a request lets go of everything: its registration, its tasks (a grammar
        compile, fetches), its sequence if still unfinished (its caller is gone, or we stop) with
        its blocks and probe pin, and its hand-off pins at the encoders."""
        seq = live.seq
        self.metrics.forget(seq.seq_id)
        self._live.pop(seq.seq_id, None)
        self._by_request.pop(key, None)
        for task in live.tasks:
            task.cancel()
        if seq.finish_reason is None:
            self.engine.cancel(seq)
            self._wakeup.set()
        if live.pinned:
            self.rows.release_pins(live, list(live.pinned))

    async def _fail(self, reply: Responder, error: ErrorReply) -> None:
        """End a generate request with ``error`` (counted by status and code)."""
        self.metrics.errored(error)
        await reply.send(error)

    # --- what the engine loop reports ---------------------------------------------------

    def _deliver(self, result: StepResult) -> None:
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

    def _distrusted(self, why: str) -> None:
        """The engine can no longer be trusted: end every live request so the processor moves it
        (the replica answers its heartbeat as unhealthy and refuses requests from now on)."""
        log.error("ending %d live request(s) so they move: %s", len(self._live), why)
        for live in self._live.values():
            live.failure = _unavailable()
            live.queue.put_nowait(StepOutput(live.seq.seq_id, None, "error", 0, 0, why))

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
        self.loop.close()
        self.grammars.close()
        self.fetcher.close()
        if self.engine.kv_tier is not None:
            self.engine.kv_tier.close()


def _unavailable() -> ErrorReply:
    # NOTE: "stage_unavailable" tells the processor to move the request to another replica.
    return ErrorReply("stage_unavailable", "this LLM replica's engine failed; it no longer serves", 503)


def _keys(spans: list[MediaSpan]) -> list[ChunkKey]:
    return [key for span in spans for key in span.chunk_keys]


def run(cfg: LLMConfig) -> None:
    spec = ModelSpec.load(cfg.model)

    async def make(ctx: zmq.Context):
        engine = Engine(cfg, spec)
        fetcher = MediaFetcher(ctx, cfg.fetch_timeout, engine.lm.config.hidden_size, spec.feature_sets)
        return await with_metrics_server(LLMService(cfg, engine, fetcher), cfg.metrics_port)

    run_stage("llm", cfg.bind, cfg.torch_threads, make, cfg.log_format)
