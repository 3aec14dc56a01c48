# ruff: noqa: F811  (``env`` is test_engine's fixture, reused by name)
"""The shared KV tier against a real Redis server, engines driven directly (no ZeroMQ).

Replica A computes a prompt and writes its blocks; replica B (a fresh engine on the same store,
as after a failover or a restart) reads them and must answer exactly as an engine without any
cache: same greedy tokens, same prompt logprobs. Faults (store killed, slow, full, restarted; a
value corrupted, truncated, or written under another layout) are served by computing, counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time

import pytest
import redis
import torch

from mmcache.kv_store_server import RedisServer
from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.kv_store import RETRY_SECONDS
from mmcache.llm_stage.kv_tier import KVTier
from mmcache.shared.block_hash import block_hashes, root_hash
from mmcache.shared.kv_block_codec import KVLayout, StoredBlock, encode
from mmcache.shared.messages import SamplingParams
from tests.llm_stage.test_engine import TEXT, Env, Prompt, build_env, env, make_engine, make_prompt, make_seq  # noqa: F401

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SCORED = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
LONG = TEXT + " Then the ferry, the gulls and the schoolhouse by the water. " * 3


@pytest.fixture
def store():
    server = RedisServer("--enable-debug-command", "yes").start()
    yield server
    server.stop()


@dataclasses.dataclass
class Outcome:
    tokens: list[int]
    prompt_logprobs: list | None
    cached: int


class Driver:
    """Steps one engine; reads the KV tier when the scheduler asks (what the service does)."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.loop = asyncio.new_event_loop()

    def run(
        self, env: Env, prompt: Prompt | list[int], sampling: SamplingParams, salt: str | None = None
    ) -> Outcome:
        p = prompt if isinstance(prompt, Prompt) else Prompt(list(prompt))
        seq = make_seq(env, self.engine, 1, p, sampling)
        seq.root_hash = root_hash(env.spec.weights_fingerprint, salt)
        self.engine.submit(seq)
        tokens: list[int] = []
        plp = None
        for _ in range(2000):
            if not self.engine.has_work():
                break
            result = self.engine.step()
            for wanted in result.kv_fetches:
                tier = self.engine.kv_tier
                assert tier is not None
                blocks = self.loop.run_until_complete(tier.fetch(wanted.hashes))
                self.engine.add_kv(wanted.seq, wanted.first, blocks)
            for out in result.outputs:
                assert out.error is None
                if out.token_id is not None:
                    tokens.append(out.token_id)
                if out.prompt_logprobs is not None:
                    plp = out.prompt_logprobs
        assert not self.engine.has_work()
        if self.engine.kv_tier is not None:
            assert self.engine.kv_tier.flush()
        return Outcome(tokens, plp, seq.num_cached_tokens)

    def close(self) -> None:
        if self.engine.kv_tier is not None:
            self.engine.kv_tier.close()
        self.loop.close()


def replica(env: Env, url: str = "", **cfg) -> Driver:
    # NOTE: generous: these tests check what a read brings, not how fast (the fault tests set theirs)
    options = {"kv_store": url, "kv_store_timeout": 5.0, **cfg} if url else cfg
    return Driver(make_engine(env, **options))


def reference(env: Env, prompt, sampling: SamplingParams) -> Outcome:
    key = ("kv-ref", id(prompt) if isinstance(prompt, Prompt) else tuple(prompt), repr(sampling))
    if key not in env.cache:
        env.cache[key] = replica(env, no_cache=True).run(env, prompt, sampling)
    return env.cache[key]


def full_blocks(prompt, block_size: int = 16) -> int:
    n = len(prompt.token_ids if isinstance(prompt, Prompt) else prompt)
    return (n - 1) // block_size * block_size


def assert_same(got: Outcome, want: Outcome) -> None:
    assert got.tokens == want.tokens
    if want.prompt_logprobs is not None:
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(want.prompt_logprobs)
        for a, b in zip(got.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a.top_ids == b.top_ids and a.rank == b.rank
            got_values, want_values = [a.logprob, *a.top_logprobs], [b.logprob, *b.top_logprobs]
            assert torch.allclose(torch.tensor(got_values), torch.tensor(want_values), atol=1e-5)


# --- exactness: a prefix from the store on a fresh replica, every family -----------------------


@pytest.mark.parametrize("kind", ["text", "image", "multi_turn"])
def test_fresh_replica_reads_the_prefix_and_answers_exactly(env: Env, store: RedisServer, kind: str):
    if kind == "text":
        prompt: Prompt | list[int] = make_prompt(env, LONG)
    elif kind == "image":
        prompt = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    else:  # turn 1 and its answer, then turn 2: the earlier turns come from the store
        first = make_prompt(env, LONG)
        answer = reference(env, first, GREEDY).tokens
        prompt = first.token_ids + answer + make_prompt(env, "And then?").token_ids
    a, b = replica(env, store.url), replica(env, store.url)
    try:
        if kind == "multi_turn":
            a.run(env, first, GREEDY)  # only turn 1 was computed, on A
        else:
            a.run(env, prompt, GREEDY)
        assert a.engine.kv_tier is not None and a.engine.kv_tier.stats.written_blocks > 0
        got = b.run(env, prompt, GREEDY)
        tier = b.engine.kv_tier
        assert tier is not None and tier.stats.loaded_blocks > 0
        want = reference(env, prompt, GREEDY)
        assert_same(got, want)
        if kind == "multi_turn":  # turn 1's prompt and the full blocks of its answer
            assert got.cached >= full_blocks(first) and got.cached == tier.stats.loaded_blocks * 16
        else:
            assert got.cached == full_blocks(prompt)
        assert sum(tier.stats.errors.values()) == 0
    finally:
        a.close()
        b.close()


def test_prompt_logprobs_come_from_the_store_unchanged(env: Env, store: RedisServer):
    prompt = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    a, b = replica(env, store.url), replica(env, store.url)
    try:
        a.run(env, prompt, SCORED)
        got = b.run(env, prompt, SCORED)
        assert got.cached > 0  # the blocks read carried their entries (else they would not match)
        assert_same(got, reference(env, prompt, SCORED))
    finally:
        a.close()
        b.close()


def test_prefix_ending_inside_an_image(env: Env, store: RedisServer):
    """Same image, another question: the store serves the full blocks up to the divergence,
    the last of which ends inside the image; the rest of the image's rows are used as computed."""
    one = make_prompt(env, "Describe the picture.", images=[(300, 200, 1)])
    two = make_prompt(env, "What colour is it?", images=[(300, 200, 1)])
    span = two.spans[0]
    a, b = replica(env, store.url), replica(env, store.url)
    try:
        a.run(env, one, GREEDY)
        got = b.run(env, two, GREEDY)
        assert span.offset < got.cached <= span.offset + span.num_tokens
        assert_same(got, reference(env, two, GREEDY))
    finally:
        a.close()
        b.close()


# --- faults: served by computing, counted (family-independent: one family) ---------------------


@pytest.fixture(scope="module")
def one_family(tiny_models) -> Env:
    """Store faults do not depend on the family: one is enough."""
    return build_env("qwen2-vl", tiny_models)


def layout(driver: Driver) -> KVLayout:
    assert driver.engine.kv_tier is not None
    return driver.engine.kv_tier.layout


def chain_keys(env: Env, driver: Driver, prompt: Prompt) -> list[str]:
    seq = make_seq(env, driver.engine, 0, prompt, GREEDY)
    return [layout(driver).key(h) for h in seq.update_block_hashes(16)]


@pytest.mark.parametrize("fault", ["checksum", "truncated", "layout"])
def test_a_bad_value_is_refused_and_the_rest_computed(one_family: Env, store: RedisServer, fault: str):
    env = one_family
    prompt = make_prompt(env, LONG)
    a, b = replica(env, store.url), replica(env, store.url)
    try:
        a.run(env, prompt, GREEDY)
        keys = chain_keys(env, a, prompt)
        r = store.client()
        value = r.get(keys[2])
        assert value is not None
        if fault == "checksum":  # one bit of the K/V flipped, straight in the store
            bad = bytearray(value)
            bad[len(bad) // 2] ^= 1
            r.set(keys[2], bytes(bad))
        elif fault == "truncated":
            r.set(keys[2], value[:-7])
        else:  # a value laid out for another dtype, under this layout's key
            other = dataclasses.replace(layout(a), dtype=torch.bfloat16)
            kv = torch.zeros(other.kv_shape, dtype=torch.bfloat16)
            seq = make_seq(env, a.engine, 0, prompt, GREEDY)
            block_hash = seq.update_block_hashes(16)[2]
            r.set(keys[2], encode(other, StoredBlock(block_hash, tuple(prompt.token_ids[32:48]), kv)))
        got = b.run(env, prompt, GREEDY)
        tier = b.engine.kv_tier
        assert tier is not None
        assert tier.stats.errors[fault] == 1
        assert got.cached == 2 * 16  # the two blocks before the bad one
        assert_same(got, reference(env, prompt, GREEDY))
    finally:
        a.close()
        b.close()


def test_store_killed_then_restarted(one_family: Env, store: RedisServer):
    env = one_family
    prompt = make_prompt(env, LONG)
    a = replica(env, store.url)
    a.run(env, prompt, GREEDY)
    store.kill()
    b = replica(env, store.url)
    try:
        got = b.run(env, prompt, GREEDY)
        tier = b.engine.kv_tier
        assert tier is not None
        assert got.cached == 0 and tier.stats.errors["connection"] == 1
        assert_same(got, reference(env, prompt, GREEDY))
        # while it is down, no request waits for it: the store is not even asked
        lookups = tier.stats.lookups
        b.run(env, make_prompt(env, "Hi there, how are you today? " * 4), GREEDY)
        assert tier.stats.lookups == lookups and tier.stats.skipped >= 1
        assert tier.stats.errors["connection"] == 1
        store.start()  # empty after a restart: hits return once blocks are written again
        time.sleep(RETRY_SECONDS + 0.1)
        c, d = replica(env, store.url), replica(env, store.url)
        c.run(env, prompt, GREEDY)
        again = d.run(env, prompt, GREEDY)
        assert again.cached == full_blocks(prompt)
        assert_same(again, reference(env, prompt, GREEDY))
        c.close()
        d.close()
    finally:
        a.close()
        b.close()


def test_store_killed_mid_read(one_family: Env, store: RedisServer):
    """The store stops answering (DEBUG SLEEP) and is killed while a read is in flight."""
    env = one_family
    prompt = make_prompt(env, LONG)
    a, b = replica(env, store.url), replica(env, store.url, kv_store_timeout=10.0)
    try:
        a.run(env, prompt, GREEDY)
        threading.Thread(
            target=lambda: _ignore(store.client().execute_command, "DEBUG", "SLEEP", "6")
        ).start()
        time.sleep(0.1)
        threading.Timer(0.3, store.kill).start()
        started = time.monotonic()
        got = b.run(env, prompt, GREEDY)
        assert time.monotonic() - started < 5.0  # ended by the kill, not by the sleep's end or the timeout
        tier = b.engine.kv_tier
        assert tier is not None and got.cached == 0 and tier.stats.errors["connection"] == 1
        assert_same(got, reference(env, prompt, GREEDY))
    finally:
        a.close()
        b.close()


def test_slow_store_times_out(one_family: Env, store: RedisServer):
    env = one_family
    prompt = make_prompt(env, LONG)
    a, b = replica(env, store.url), replica(env, store.url, kv_store_timeout=0.2)
    try:
        a.run(env, prompt, GREEDY)
        threading.Thread(
            target=lambda: _ignore(store.client().execute_command, "DEBUG", "SLEEP", "5")
        ).start()
        time.sleep(0.1)
        started = time.monotonic()
        got = b.run(env, prompt, GREEDY)
        tier = b.engine.kv_tier
        assert tier is not None and got.cached == 0 and tier.stats.errors["timeout"] == 1
        assert time.monotonic() - started < 4.0  # ended by the timeout, not by the sleep's end
        assert_same(got, reference(env, prompt, GREEDY))
    finally:
        a.close()
        b.close()


def test_full_store_drops_writes(one_family: Env):
    env = one_family
    server = RedisServer("--maxmemory", "1mb", "--maxmemory-policy", "noeviction").start()
    prompt = make_prompt(env, LONG)
    a = replica(env, server.url)
    try:
        got = a.run(env, prompt, GREEDY)
        tier = a.engine.kv_tier
        assert tier is not None and tier.stats.errors["full"] >= 1 and tier.stats.dropped_blocks > 0
        assert_same(got, reference(env, prompt, GREEDY))
    finally:
        a.close()
        server.stop()


def test_salts_and_layouts_never_share_a_block(one_family: Env, store: RedisServer):
    env = one_family
    prompt = make_prompt(env, LONG)
    drivers = [replica(env, store.url) for _ in range(3)]
    other_layout = replica(env, store.url, block_size=32)
    other_dtype = replica(env, store.url, dtype="bfloat16")
    try:
        drivers[0].run(env, prompt, GREEDY, salt="tenant-a")
        assert drivers[1].run(env, prompt, GREEDY, salt="tenant-b").cached == 0
        assert drivers[2].run(env, prompt, GREEDY, salt="tenant-a").cached == full_blocks(prompt)
        # same weights, same salt (None), another KV layout: the store holds none of their blocks
        drivers[0].run(env, prompt, GREEDY)
        assert other_layout.run(env, prompt, GREEDY).cached == 0
        assert other_dtype.run(env, prompt, GREEDY).cached == 0
        for d in (other_layout, other_dtype):
            assert d.engine.kv_tier is not None and sum(d.engine.kv_tier.stats.errors.values()) == 0
    finally:
        for d in (*drivers, other_layout, other_dtype):
            d.close()


def exists_calls(client: redis.Redis) -> int:
    return client.info("commandstats").get("cmdstat_exists", {}).get("calls", 0)


@contextlib.contextmanager
def two_replicas(env: Env, url: str):
    a, b = replica(env, url), replica(env, url)
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def tier_of(driver: Driver) -> KVTier:
    assert driver.engine.kv_tier is not None
    return driver.engine.kv_tier


def chain_of(env: Env, prompt: Prompt) -> list:
    return block_hashes(prompt.token_ids, prompt.spans, 16, root_hash(env.spec.weights_fingerprint, None))


def test_a_probe_that_found_nothing_spares_the_request_a_second_read(one_family: Env, store: RedisServer):
    """The processor probes, then sends the request: a prefix the probe found absent is computed
    without asking the store again (one round trip, not two); a probe that found it reads it."""
    env = one_family
    prompt = make_prompt(env, LONG + " A probe first.")
    chain = chain_of(env, prompt)
    client = redis.Redis.from_url(store.url)
    with two_replicas(env, store.url) as (a, b):
        tier = tier_of(b)
        exists = exists_calls(client)
        assert b.loop.run_until_complete(tier.stored(chain)) == 0
        assert exists_calls(client) == exists + 1  # one block asked about, not the whole chain
        lookups, skipped = tier.stats.lookups, tier.stats.skipped
        got = b.run(env, prompt, GREEDY)
        assert tier.stats.lookups == lookups and tier.stats.skipped == skipped + 1
        assert_same(got, reference(env, prompt, GREEDY))
        # the same prompt, written by A meanwhile: B's probe now finds it, B reads it
        a.run(env, prompt, GREEDY)
        fresh = replica(env, store.url)
        try:
            tier = tier_of(fresh)
            exists = exists_calls(client)
            assert fresh.loop.run_until_complete(tier.stored(chain)) == full_blocks(prompt) // 16
            assert exists_calls(client) == exists + len(chain)  # the first, then the rest
            again = fresh.run(env, prompt, GREEDY)
            assert tier.stats.lookups == 1 and tier.stats.skipped == 0
            assert again.cached == full_blocks(prompt)
            assert_same(again, reference(env, prompt, GREEDY))
        finally:
            fresh.close()


def test_a_probe_that_finds_the_prefix_clears_an_older_absent_mark(one_family: Env, store: RedisServer):
    """B is probed while the store lacks a prompt, its request goes to A; the next turn's probe
    finds A's blocks on B: B reads them (the older mark does not send it to compute)."""
    env = one_family
    prompt = make_prompt(env, LONG + " Probed twice.")
    chain = chain_of(env, prompt)
    with two_replicas(env, store.url) as (a, b):
        tier = tier_of(b)
        assert b.loop.run_until_complete(tier.stored(chain)) == 0  # marked absent on B
        a.run(env, prompt, GREEDY)  # the request went to A, which wrote its blocks
        assert b.loop.run_until_complete(tier.stored(chain)) == full_blocks(prompt) // 16
        got = b.run(env, prompt, GREEDY)
        assert tier.stats.lookups == 1 and tier.stats.skipped == 0
        assert got.cached == full_blocks(prompt)
        assert_same(got, reference(env, prompt, GREEDY))


def _ignore(fn, *args) -> None:
    with contextlib.suppress(Exception):  # the server is killed under it
        fn(*args)
