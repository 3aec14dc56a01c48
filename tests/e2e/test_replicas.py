"""Two encoder replicas and two LLM replicas behind one processor, each stage its own process
(``mmcache encoder|llm|processor`` as compose runs them): chunks shard across the encoders by
rendezvous hashing, the LLM stage pulls rows from whichever encoder owns them, and a repeated
request goes to the LLM replica that holds its prefix."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import pytest

from mmcache.scrape import Samples, endpoints, scrape_endpoints
from mmcache.shared.routing import rendezvous
from tests.e2e.server import free_port, stage_env, wait_healthy
from tests.e2e.util import chat, image_part, tokens
from tests.media import image_bytes

pytestmark = pytest.mark.e2e


class Stack:
    """``encoders`` + ``llms`` stage replicas and ``processors`` processors that reach them all;
    ``procs`` in that order, ``port``/``url`` the first processor's."""

    def __init__(self, model, encoders: int, llms: int, processors: int = 1):
        env = stage_env()
        self.encoders = [f"tcp://127.0.0.1:{free_port()}" for _ in range(encoders)]
        self.llms = [f"tcp://127.0.0.1:{free_port()}" for _ in range(llms)]
        self.ports = [free_port() for _ in range(processors)]
        self.port = self.ports[0]
        self.url = f"http://127.0.0.1:{self.port}"
        base = [sys.executable, "-m", "mmcache"]
        cmds = [[*base, "encoder", "--model", str(model), "--bind", a] for a in self.encoders]
        cmds += [[*base, "llm", "--model", str(model), "--bind", a] for a in self.llms]
        targets = ["--encoder", ",".join(self.encoders), "--llm", ",".join(self.llms)]
        cmds += [
            [*base, "processor", "--model", str(model), "--host", "127.0.0.1", "--port", str(port), *targets]
            for port in self.ports
        ]
        self.procs = [
            subprocess.Popen(c, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for c in cmds
        ]
        try:
            for port in self.ports:
                wait_healthy(f"http://127.0.0.1:{port}", self.procs)
        except RuntimeError:
            self.stop()
            raise

    def post(self, body: dict) -> dict:
        req = urllib.request.Request(
            self.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=120) as resp:
            return json.loads(resp.read())

    def metrics(self) -> dict[str, Samples]:
        """Each stage replica's own /metrics (found through the processor's /health), by address."""
        return {ep.address: samples for ep, samples in scrape_endpoints(endpoints(self.url))}

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture(scope="module")
def stack(tiny_model):
    s = Stack(tiny_model, encoders=2, llms=2)
    yield s
    s.stop()
    assert all(p.poll() is not None for p in s.procs)


def per_replica(metrics: dict[str, Samples], name: str, addresses: list[str]) -> list[float]:
    return [metrics[a][f"mmcache_{name}"] for a in addresses]


def test_chunks_shard_across_encoders_and_prefixes_route_back(stack):
    model = "qwen2-vl"
    bodies = []
    # NOTE: each replica tier picks by rendezvous over addresses on free ports picked at random, so
    # n distinct prompts all land on one of two replicas with chance 2**(1 - n): 1 in 128 for the
    # 8 this test sent at first (a CI run saw LLM queries [0, 1488]); 1 in 8 million for 24.
    n = 24
    for seed in range(n):
        img = image_bytes(224, 224, seed=300 + seed)
        body = chat(model, [image_part(img), {"type": "text", "text": f"Image {seed}?"}], system=f"S{seed}")
        bodies.append((body, tokens(stack.post(body))))
    m = stack.metrics()
    encoded = per_replica(m, "encoder_chunks_encoded_total", stack.encoders)
    assert sum(encoded) == n and all(e > 0 for e in encoded), encoded  # both shards used
    fetched = per_replica(m, "encoder_fetches_total", stack.encoders)
    assert fetched == encoded  # every LLM replica pulled each chunk from the encoder that made it
    # Repeats: each goes back to the replica holding its prefix, so every one is a prefix hit.
    for body, first in bodies:
        again = stack.post(body)
        assert tokens(again) == first
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert again["usage"]["mm_cache"]["prefix_skipped"] == 1
    after = stack.metrics()
    assert per_replica(after, "encoder_chunks_encoded_total", stack.encoders) == encoded  # nothing re-encoded
    queries = per_replica(after, "llm_prefix_cache_queries_total", stack.llms)
    assert all(q > 0 for q in queries), queries  # both LLM replicas served requests


def test_rendezvous_is_stable_and_moves_only_the_lost_shard():
    keys = [bytes([i]) * 16 for i in range(200)]
    three = ["tcp://a:1", "tcp://b:1", "tcp://c:1"]
    owner = {k: rendezvous(k, three) for k in keys}
    assert {rendezvous(k, list(reversed(three))) for k in keys} <= set(three)
    assert all(rendezvous(k, list(reversed(three))) == owner[k] for k in keys)  # order does not matter
    assert len(set(owner.values())) == 3
    two = three[:2]
    moved = [k for k in keys if rendezvous(k, two) != owner[k]]
    assert all(owner[k] == "tcp://c:1" for k in moved)  # only the lost replica's keys move
