"""A multi-node Swarm (three docker-in-docker nodes, one Swarm for the module): ``docker stack
deploy`` of compose.yaml across the nodes answers as under compose; ``docker service scale`` of
the encoder from 1 to 3 is picked up live (the new replicas, on other nodes, get shards); and a
worker cut off the network under a streaming load fails no request, after which the replacement
tasks Swarm starts elsewhere are found and serve."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager

import pytest

from tests.deploy.docker import ROOT, answers, bodies, get, replica_metrics, up_replicas, wait_for
from tests.deploy.swarm import Swarm, disk_free
from tests.e2e.streams import check_unchanged, failover_counters, failover_delta, run_all, stream_bodies

pytestmark = pytest.mark.deploy

STARTUP = 420  # seconds: the stage containers of three nodes load torch on two cores
SERVICES = ("mmcache_encoder", "mmcache_llm", "mmcache_processor")
CONCURRENT = 30
MAX_TOKENS = 192  # long enough that every stream is still going when the node is cut (96 is, here)


@pytest.fixture(scope="module")
def swarm(image):
    """Three nodes with the image, the stack deployed: the processor on the manager (node 0), the
    LLM replicas on the workers."""
    started = time.monotonic()
    s = Swarm(3)
    try:
        s.load(image)
        took = time.monotonic() - started
        print(f"\nswarm of 3 up and the image loaded into each in {took:.0f} s; {disk_free()}")
        env = {"MMCACHE_IMAGE": image, "PORT": "8000", "MMCACHE_TORCH_THREADS": "1"}
        files = [str(ROOT / "compose.yaml"), str(ROOT / "tests/deploy/swarm-placement.yaml")]
        s.deploy("mmcache", files, env)
        yield s
    finally:
        s.close()


@contextmanager
def tasks_shown(swarm: Swarm):
    """On a failure, print where each task runs and what became of it."""
    try:
        yield
    except BaseException:
        print(swarm.manage("service", "ps", *SERVICES, check=False))
        raise


def processor_url(swarm: Swarm) -> str:
    def up() -> str | None:
        if not any(s.startswith("Running") for _, s in swarm.tasks("mmcache_processor")):
            return None
        url = f"http://{swarm.ip(swarm.nodes[0])}:8000"  # host-mode port on the manager
        return url if get(url + "/health", timeout=10)[0] == 200 else None

    return wait_for("the stack", up, STARTUP, every=3)


def wait_replicas(base: str, encoders: int, llms: int) -> None:
    wait_for(
        f"{encoders} encoder(s) and {llms} LLM replicas up",
        lambda: len(up_replicas(base, "encoder")) == encoders and len(up_replicas(base, "llm")) == llms,
        STARTUP,
        every=3,
    )


def replica_ids(base: str, stage: str) -> set[str]:
    """Ids of the ``stage`` replicas answering the processor now."""
    _, body = get(base + "/health")
    return {r["id"] for r in body["stages"] if r["stage"] == stage and r["ok"]}


def test_stack_deploys_across_nodes_and_scales_live(swarm, reference):
    with tasks_shown(swarm):
        swarm.manage("service", "scale", "-d", "mmcache_encoder=1", "mmcache_llm=2")
        base = processor_url(swarm)
        wait_replicas(base, 1, 2)
        assert answers(base, reference["bodies"]) == reference["answers"]
        before = set(replica_metrics(base)["encoder_chunks_encoded"])

        swarm.manage("service", "scale", "-d", "mmcache_encoder=3")
        wait_for("three encoders", lambda: len(up_replicas(base, "encoder")) == 3, STARTUP, every=3)
        nodes = {n for n, _ in swarm.tasks("mmcache_encoder")}
        assert len(nodes) >= 2, nodes  # spread over the nodes
        more = bodies(reference["model"], range(200, 224))
        assert len(answers(base, more)) == len(more)
        encoded = replica_metrics(base)["encoder_chunks_encoded"]
        new = set(encoded) - before
        assert len(new) == 2 and all(encoded[a] > 0 for a in new), encoded  # the new ones hold shards


class Watch(threading.Thread):
    """From the cut on, once a second: when Swarm marks the node Down, and when a replica id not
    seen before answers the processor (the replacement task, found by its name)."""

    def __init__(self, swarm: Swarm, node: str, base: str, seen: set[str]):
        super().__init__(daemon=True)
        self.swarm, self.node, self.base, self.seen = swarm, node, base, seen
        self.cut_at = time.monotonic()
        self.down: float | None = None
        self.replaced: float | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        deadline = self.cut_at + STARTUP
        while not self.stop.wait(1.0) and time.monotonic() < deadline:
            try:
                if self.down is None and self.swarm.status(self.node) == "down":
                    self.down = time.monotonic() - self.cut_at
                if self.replaced is None and replica_ids(self.base, "llm") - self.seen:
                    self.replaced = time.monotonic() - self.cut_at
            except (AssertionError, OSError, ValueError):  # a busy manager or processor: next round
                continue
            if self.down is not None and self.replaced is not None:
                return


def test_worker_cut_off_the_network_fails_nothing_and_its_tasks_are_replaced(swarm, reference):
    with tasks_shown(swarm):
        swarm.manage("service", "scale", "-d", "mmcache_encoder=2", "mmcache_llm=2")
        base = processor_url(swarm)
        wait_replicas(base, 2, 2)
        # Each LLM replica's node (a task's host name is its container's short id); the placement
        # puts the two on the two workers.
        node_of = {c: n for n in swarm.nodes[1:] for c in swarm.containers(n, "mmcache_llm")}
        encoder_nodes = sorted(n for n, s in swarm.tasks("mmcache_encoder") if s.startswith("Running"))
        print(f"\nLLM replicas on {node_of}; encoders on {encoder_nodes}")
        seen = replica_ids(base, "llm")
        encoders_seen = replica_ids(base, "encoder")
        host = swarm.ip(swarm.nodes[0])

        def load(salt: str) -> list[dict]:
            return stream_bodies(reference["model"], salt, 0, CONCURRENT, MAX_TOKENS)

        def run(requests: list[dict], kill=None):
            return run_all(host, 8000, requests, kill, after=len(requests), start_timeout=STARTUP)

        want, _ = run(load("uninterrupted"))
        before = failover_counters(base)
        watch: list[Watch] = []

        def cut() -> None:
            """Cut the worker whose LLM replica runs the most of the streams off the network."""
            _, health = get(base + "/health")
            loads = {r["id"]: r["load"] for r in health["stages"] if r["stage"] == "llm" and r["ok"]}
            busiest = max(loads, key=loads.get)
            node = node_of[busiest.split("/")[0]]
            print(f"LLM replicas' load at the cut: {loads}; cutting {node}")
            watch.append(Watch(swarm, node, base, seen))
            swarm.cut(node)
            watch[0].start()

        got, window = run(load("cut"), cut)
        delta = failover_delta(base, before)
        check_unchanged(f"Swarm: {watch[0].node} cut off", got, want, delta, window, MAX_TOKENS)
        assert delta["migrated"] > 0, delta  # the cut replica's streams moved mid-answer
        assert delta["exhausted"] == 0, delta

        # Swarm marks the node Down and starts its tasks elsewhere; the processor finds the new LLM
        # replica by the service's name, and it serves new requests.
        w = watch[0]
        w.join(timeout=STARTUP)
        assert w.down is not None and w.replaced is not None, (w.down, w.replaced)
        print(f"node Down after {w.down:.1f} s, a new LLM replica answering after {w.replaced:.1f} s")
        (new,) = replica_ids(base, "llm") - seen
        wait_replicas(base, 2, 2)  # both tiers at full strength again (an encoder replaced too)
        print(f"new encoder replicas: {replica_ids(base, 'encoder') - encoders_seen or 'none'}")
        # each its own system prompt: the prompts' first blocks rank the replicas apart
        more = bodies(reference["model"], range(300, 316))
        assert len(answers(base, more)) == len(more)
        _, health = get(base + "/health")
        steps = {
            r["id"]: (r["counters"] or {}).get("steps", 0) for r in health["stages"] if r["stage"] == "llm"
        }
        print(f"LLM replicas' steps after the cut: {steps}")
        assert steps.get(new, 0) > 0, steps  # the replacement serves
