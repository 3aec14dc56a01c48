"""``docker compose up --scale`` for real: the repo's image and compose.yaml on a real Docker Engine.

The same image and video requests get the same greedy answers as ``mmcache serve`` in one
container; per-replica counters show both encoders holding shards and both LLM replicas serving;
``--scale encoder=3`` on the running stack is picked up; ``down`` leaves nothing behind.
"""

from __future__ import annotations

import time

import pytest

from tests.deploy.compose import project
from tests.deploy.docker import (
    STARTUP,
    answers,
    bodies,
    healthy,
    replica_metrics,
    sh,
    until_each_replica_works,
    up_replicas,
    wait_for,
)

pytestmark = pytest.mark.deploy


def test_compose_scales_each_tier(image, reference):
    with project(image) as p:
        base = p.base
        scale = ("up", "-d", "--no-build", "--scale", "llm=2")
        p.compose(*scale, "--scale", "encoder=2")
        wait_for("the compose stack", lambda: healthy(base), STARTUP)
        wait_for(
            "2 encoders and 2 LLM replicas up",
            lambda: len(up_replicas(base, "encoder")) == 2 and len(up_replicas(base, "llm")) == 2,
            STARTUP,
        )
        assert answers(base, reference["bodies"]) == reference["answers"]
        until_each_replica_works(base, reference["model"], range(300, 332))
        m = replica_metrics(base)
        encoded = m["encoder_chunks_encoded"]
        assert len(encoded) == 2 and all(v > 0 for v in encoded.values()), encoded  # both hold shards
        steps = m["llm_steps"]
        assert len(steps) == 2 and all(v > 0 for v in steps.values()), steps  # both serve

        # Scale the running stack: the processor finds the third encoder by its name alone.
        before = set(encoded)
        p.compose(*scale, "--no-recreate", "--scale", "encoder=3")
        wait_for("a third encoder", lambda: len(up_replicas(base, "encoder")) == 3, STARTUP)
        more = bodies(reference["model"], range(100, 124))
        assert len(answers(base, more)) == len(more)
        encoded = replica_metrics(base)["encoder_chunks_encoded"]
        (new,) = set(encoded) - before
        assert encoded[new] > 0, encoded  # the new replica got its shard
        assert all(encoded[a] > 0 for a in before)

        # SIGTERM stops every stage by itself (no SIGKILL after the grace period).
        started = time.monotonic()
        p.compose("stop", "-t", "30")
        ids = p.containers()
        print(f"\n{len(ids)} containers stopped in {time.monotonic() - started:.1f} s")
        codes = {i: sh("docker", "inspect", "-f", "{{.State.ExitCode}}", i).strip() for i in ids}
        # 3 encoders, 2 LLM replicas, the processor and the KV store
        assert len(ids) == 7 and "137" not in codes.values(), codes
