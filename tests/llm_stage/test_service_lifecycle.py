"""A request's life in the LLM stage, and the supervised engine loop.

A real :class:`LLMService` on the tiny checkpoint serves real ZeroMQ (ipc) inside this process;
the test talks to it with the processor's :class:`RpcClient`. Faults are injected through the
engine's fault hook (:class:`llm_stage.faults.StepFaults`), the way a bug in a step surfaces.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from pathlib import Path

import llguidance
import pytest
import torch
import zmq.asyncio

from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.grammar import GrammarCache
from mmcache.llm_stage.media_fetch import MediaFetcher
from mmcache.llm_stage.service import LLMService
from mmcache.shared.checkpoint import ModelSpec
from mmcache.shared.config import LLMConfig
from mmcache.shared.discovery import ReplicaSet
from mmcache.shared.messages import (
    ErrorReply,
    GenerateReply,
    GenerateRequest,
    Ping,
    Pong,
    ProbeReply,
    ProbeRequest,
    SamplingParams,
)
from mmcache.shared.rpc import RemoteError, RpcClient, RpcServer

MAX_TOKENS = 12


class CountingEngine(Engine):
    """The real engine, counting the calls the service makes into it from the event loop."""

    ENTRIES = ("probe", "release_pin", "submit", "cancel", "add_rows", "grammar_ready", "fail")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls: list[str] = []

    def __getattribute__(self, name):
        if name in CountingEngine.ENTRIES:
            object.__getattribute__(self, "calls").append(name)
        return object.__getattribute__(self, name)


class SlowGrammars(GrammarCache):
    """Compiles only once the test opens ``gate`` (a grammar that takes long to compile)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()

    def _compile(self, grammar):
        assert self.gate.wait(30)
        return super()._compile(grammar)


@contextlib.asynccontextmanager
async def served(model: Path, tmp: Path, **cfg):
    spec = ModelSpec.load(model)
    ctx = zmq.asyncio.Context()
    address = f"ipc://{tmp}/llm.sock"
    llm_cfg = LLMConfig(model=str(model), num_kv_blocks=128, **cfg)
    engine = CountingEngine(llm_cfg, spec)
    service = LLMService(llm_cfg, engine, MediaFetcher(ctx, 10.0, engine.lm.config.hidden_size))
    server = RpcServer(ctx, address, service.handle, quick=service.quick)
    task = asyncio.create_task(server.serve_forever())
    client = RpcClient(ctx, address, "llm")
    try:
        yield service, engine, client, address, ctx
    finally:
        client.close()
        task.cancel()
        server.close()
        service.close()
        ctx.destroy(linger=0)


def prompt(seed: int, n: int = 40) -> torch.Tensor:
    return torch.randint(10, 500, (n,), generator=torch.Generator().manual_seed(seed), dtype=torch.int32)


def request(ids: torch.Tensor, probe_id: int = 0, **sampling) -> GenerateRequest:
    params = SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **sampling})
    return GenerateRequest(ids, [], [], [], params, probe_id=probe_id)


async def generate(client: RpcClient, msg: GenerateRequest) -> list[int] | ErrorReply:
    """The tokens of a generation, or the error it ended with."""
    tokens: list[int] = []
    try:
        async with client.stream(msg, timeout=60) as replies:
            async for reply in replies:
                assert isinstance(reply, GenerateReply)
                tokens += reply.token_ids
    except RemoteError as exc:
        return exc.reply
    return tokens


async def until(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


def generated(service: LLMService) -> float:
    """The stage's generated-token counter, as Prometheus reads it."""
    value = service.metrics.registry.get_sample_value("mmcache_llm_generation_tokens_total")
    return value or 0.0


def no_pins(engine: Engine) -> bool:
    return not engine.blocks.pins and all(b.ref_count == 0 for b in engine.blocks.blocks)


async def test_a_failed_model_step_fails_its_requests_and_the_loop_serves_on(tiny_model, tmp_path):
    async with served(tiny_model, tmp_path, max_num_seqs=2) as (service, engine, client, _, _):
        prompts = [prompt(i) for i in range(6)]
        reference = [await generate(client, request(p)) for p in prompts]
        assert all(isinstance(r, list) and len(r) == MAX_TOKENS for r in reference)
        engine.faults.arm("compute")  # the next step that runs the model raises
        outcomes = await asyncio.gather(*(generate(client, request(p)) for p in prompts))
        failed = [o for o in outcomes if isinstance(o, ErrorReply)]
        # at most max_num_seqs requests were in the failed step; the others were served, unchanged
        assert 1 <= len(failed) <= 2
        assert all(o.status == 500 and o.code == "engine_error" and "injected" in o.message for o in failed)
        for got, want in zip(outcomes, reference, strict=True):
            assert isinstance(got, ErrorReply) or got == want
        assert engine.num_step_failures == 1
        assert service.stats()["step_failures"] == 1
        # the loop lives on: every later request is served
        later = await asyncio.gather(*(generate(client, request(p)) for p in prompts[:3]))
        assert later == reference[:3]
        assert service.healthy and service.pong().healthy
        assert service.loop.running
        assert no_pins(engine) and not engine.has_work()


async def test_a_step_failure_outside_the_model_takes_the_replica_out_of_routing(tiny_model, tmp_path):
    async with served(tiny_model, tmp_path) as (service, engine, client, address, ctx):
        replicas = ReplicaSet(ctx, [address], "llm")
        try:
            assert await replicas.ping(replicas.replicas[address]) is None
            assert [r.address for r in replicas.live()] == [address]
            engine.faults.arm("schedule")  # the engine's own state can no longer be trusted
            outcome = await generate(client, request(prompt(1)))
            # the processor moves a request that ends so (see processor.dispatch._gone)
            assert isinstance(outcome, ErrorReply)
            assert (outcome.status, outcome.code) == (503, "stage_unavailable")
            # one heartbeat: it says it is unhealthy, and discovery drops it
            assert await replicas.ping(replicas.replicas[address]) == "unhealthy"
            assert not replicas.replicas[address].alive and replicas.live() == []
            pong = await client.call(Ping(), timeout=5)
            assert isinstance(pong, Pong) and not pong.healthy
            assert service.stats()["healthy"] == 0
            # and it refuses work rather than letting it wait for a loop that no longer steps
            later = await asyncio.wait_for(generate(client, request(prompt(2))), 5)
            assert isinstance(later, ErrorReply) and later.code == "stage_unavailable"
            with pytest.raises(RemoteError) as probe:
                await client.call(ProbeRequest(prompt(2), []), timeout=5)
            assert probe.value.reply.code == "stage_unavailable"
        finally:
            replicas.close()


async def test_abort_during_a_slow_grammar_compile_generates_nothing(tiny_model, tmp_path):
    async with served(tiny_model, tmp_path) as (service, engine, client, _, _):
        spec = service.spec
        service.grammars = grammars = SlowGrammars(spec.path, engine.lm.vocab_size, list(spec.eos_token_ids))
        grammar = llguidance.LLMatcher.grammar_from_lark('start: "a"+')
        tokens_before = generated(service)
        msg = request(prompt(3), grammar=grammar)
        async with client.stream(msg, timeout=30):
            # registered at once, waiting in the scheduler for its grammar
            await until(lambda: len(engine.scheduler.compiling) == 1)
            assert len(service._live) == 1
        # leaving the stream early sends Abort: the request ends while its grammar still compiles
        await until(lambda: not service._live and not engine.scheduler.compiling and not engine.has_work())
        assert grammars.stats.compiles == 0
        grammars.gate.set()  # the compile finishes for nobody ...
        await until(lambda: grammars.stats.compiles == 1)
        await asyncio.sleep(0.1)
        assert generated(service) == tokens_before  # ... and nothing ran
        assert engine.num_steps == 0 and no_pins(engine)
        # the compiled grammar was kept: the next request with it is a cache hit and is served
        served_tokens = await generate(client, request(prompt(3), grammar=grammar))
        assert isinstance(served_tokens, list) and served_tokens
        assert (grammars.stats.compiles, grammars.stats.hits) == (1, 1)


async def test_a_bad_grammar_ends_the_request_with_a_400_and_its_pin(tiny_model, tmp_path):
    async with served(tiny_model, tmp_path) as (_service, engine, client, _, _):
        ids = prompt(4, 80)
        assert isinstance(await generate(client, request(ids)), list)  # its prefix is cached now
        probe = await client.call(ProbeRequest(ids, []), timeout=5)
        assert isinstance(probe, ProbeReply) and probe.probe_id and engine.blocks.pins
        outcome = await generate(client, request(ids, probe.probe_id, grammar="not a grammar"))
        assert isinstance(outcome, ErrorReply)
        assert (outcome.status, outcome.code) == (400, "bad_grammar")
        assert no_pins(engine)


@pytest.mark.parametrize("why", ["bad_sampling", "overloaded"])
async def test_a_refused_request_leaves_no_pin(tiny_model, tmp_path, why):
    cfg = {"max_queue": 1} if why == "overloaded" else {}
    async with served(tiny_model, tmp_path, **cfg) as (service, engine, client, _, _):
        ids = prompt(5, 80)
        assert isinstance(await generate(client, request(ids)), list)
        if why == "overloaded":  # the queue's one place taken by a request waiting for its grammar
            engine.submit(service._sequence(request(prompt(50), grammar="start: 'a'")))
        probe = await client.call(ProbeRequest(ids, []), timeout=5)
        assert isinstance(probe, ProbeReply) and probe.cached_tokens and probe.probe_id
        assert len(engine.blocks.pins) == 1
        engine.calls.clear()
        if why == "bad_sampling":
            msg = request(ids, probe.probe_id, temperature=-1.0)
        else:
            msg = request(ids, probe.probe_id)
        outcome = await generate(client, msg)
        assert isinstance(outcome, ErrorReply) and outcome.code == why
        # at once, or right after the step in flight (the probe woke the loop, and with the waiting
        # request it steps): well before the pin's 10 s expiry
        await until(lambda: no_pins(engine), timeout=2.0)
        assert engine.calls == ["release_pin"]


async def test_a_generate_request_enters_the_engine_once(tiny_model, tmp_path):
    async with served(tiny_model, tmp_path) as (_service, engine, client, _, _):
        ids = prompt(6, 80)
        first = await generate(client, request(ids))
        probe = await client.call(ProbeRequest(ids, []), timeout=5)
        engine.calls.clear()
        again = await generate(client, request(ids, probe.probe_id))
        assert again == first
        assert engine.calls == ["submit"]  # the scheduler let the probe's pin go, and ended it
        assert no_pins(engine)


async def test_an_unused_pin_expires_at_its_deadline(tiny_model, tmp_path):
    async with served(tiny_model, tmp_path) as (_service, engine, client, _, _):
        ids = prompt(7, 80)
        assert isinstance(await generate(client, request(ids)), list)
        steps = engine.num_steps
        probe = await client.call(ProbeRequest(ids, [], ttl=0.3), timeout=5)
        assert probe.probe_id and engine.blocks.pins
        await asyncio.sleep(0.15)
        assert engine.blocks.pins  # not before its expiry
        await until(lambda: no_pins(engine), timeout=2.0)
        assert engine.num_steps == steps  # no model step was needed for that
