"""A multi-node Swarm (three docker-in-docker nodes): ``docker stack deploy`` of compose.yaml
across the nodes answers as under compose, and ``docker service scale`` of the encoder from 1 to
3 is picked up live: the new replicas, on other nodes, get shards."""

from __future__ import annotations

import time

import pytest

from tests.deploy.docker import ROOT, answers, bodies, get, replica_metrics, up_replicas, wait_for
from tests.deploy.swarm import Swarm

pytestmark = pytest.mark.deploy

STARTUP = 420  # seconds: the stage containers of three nodes load torch on two cores


def test_stack_deploys_across_nodes_and_scales_live(image, reference):
    started = time.monotonic()
    swarm = Swarm(3)
    try:
        swarm.load(image)
        print(f"\nswarm of 3 up and the image loaded into each in {time.monotonic() - started:.0f} s")
        env = {"MMCACHE_IMAGE": image, "PORT": "8000", "MMCACHE_TORCH_THREADS": "1"}
        swarm.deploy("mmcache", str(ROOT / "compose.yaml"), env)
        swarm.manage("service", "scale", "-d", "mmcache_encoder=1", "mmcache_llm=2")

        def processor_url() -> str | None:
            running = [n for n, state in swarm.tasks("mmcache_processor") if state.startswith("Running")]
            if not running:
                return None
            url = f"http://{swarm.ip(running[0])}:8000"  # host-mode port on the node that runs it
            return url if get(url + "/health", timeout=10)[0] == 200 else None

        base = wait_for("the stack", processor_url, STARTUP, every=3)
        wait_for(
            "1 encoder and 2 LLM replicas up",
            lambda: len(up_replicas(base, "encoder")) == 1 and len(up_replicas(base, "llm")) == 2,
            STARTUP,
        )
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
    except BaseException:
        services = ("mmcache_encoder", "mmcache_llm", "mmcache_processor")
        print(swarm.manage("service", "ps", *services, check=False))
        raise
    finally:
        swarm.close()
