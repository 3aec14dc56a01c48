"""Encoder fan-out: rendezvous vs round-robin, by the encoder cache hit rate.

Two real encoder processes (``mmcache encoder --bind tcp://127.0.0.1:PORT``), each with an
embedding cache that holds C images, and a working set of 1.8·C distinct images replayed in
a new random order each pass (the first pass fills the caches and is not counted). Each image goes
to one replica, looked up there and encoded where missing, as the processor does:

- rendezvous: the owner by rendezvous hashing of the chunk key over the replicas' own ids
  (``shared.discovery.ReplicaSet``, the processors' and LLM replicas' rule): each replica holds
  its ~0.9·C shard, which fits;
- round-robin (vLLM's and SGLang's encoder fan-out): every replica sees the whole working set,
  which does not fit, and LRU evicts each image before it comes back.

Goals: hit rate >= 0.85 with rendezvous, <= 0.6 with round-robin. The hit counts come from the
replicas' own counters (Pong), checked against what the client saw.
"""

from __future__ import annotations

import asyncio
import itertools
import time

import numpy as np
import torch
import zmq.asyncio

from mmcache.benchmarks.common import Result, StageProcess, free_port, main, model_dir, say
from mmcache.harness import STARTUP_TIMEOUT

CAPACITY = 100  # images per replica cache (C)
QUICK_CAPACITY = 40
WORKING_SET = 1.8  # distinct images, in units of C
PASSES = 4  # replays after the warm-up pass
IMAGE = 56  # pixels a side: 4 tokens an image (the cache holds rows, the size does not matter)
RENDEZVOUS_GOAL = 0.85
ROUND_ROBIN_GOAL = 0.6
CALL_TIMEOUT = 60.0


def _images(n: int) -> list[tuple[bytes, torch.Tensor]]:
    rng = np.random.default_rng(11)
    return [
        (
            i.to_bytes(8, "big") * 2,
            torch.from_numpy(rng.integers(0, 256, (1, 3, IMAGE, IMAGE), dtype=np.uint8)),
        )
        for i in range(n)
    ]


async def _wait_up(replicas, procs: list[StageProcess]) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT
    while time.monotonic() < deadline:
        for p in procs:
            p.check_running()
        await replicas.ping_all(timeout=2.0)
        if all(r.alive for r in replicas.replicas.values()):
            return
        await asyncio.sleep(0.5)
    raise RuntimeError("the encoders did not answer:\n" + "\n".join(p.log_tail() for p in procs))


async def _one(client, key: bytes, pixels: torch.Tensor) -> bool:
    """Look the image up at its replica and encode it there if missing; True on a hit."""
    from mmcache.shared.messages import EncodeItem, EncodeRequest, LookupRequest

    reply = await client.call(LookupRequest([key], handoff=False), timeout=CALL_TIMEOUT)
    if not reply.missing:
        return True
    await client.call(EncodeRequest([EncodeItem(key, "image", pixels)], handoff=False), timeout=CALL_TIMEOUT)
    return False


async def _entry_bytes(ctx) -> int:
    """Bytes one cached image takes, measured on a throwaway encoder."""
    from mmcache.shared.discovery import ReplicaSet

    address = f"tcp://127.0.0.1:{free_port()}"
    proc = StageProcess(["encoder", "--model", str(model_dir()), "--bind", address])
    replicas = ReplicaSet(ctx, [address], "encoder")
    try:
        await _wait_up(replicas, [proc])
        (replica,) = replicas.replicas.values()
        key, pixels = _images(1)[0]
        await _one(replica.client, key, pixels)
        await replicas.ping(replica)
        return int(replica.pong.info["cache_bytes"])
    finally:
        replicas.close()
        proc.stop()


async def _policy(ctx, name: str, capacity: int, entry: int, images) -> tuple[float, dict]:
    from mmcache.shared.discovery import ReplicaSet

    # Room for `capacity` entries and half of one more: the cache is bounded in bytes.
    gib = (capacity + 0.5) * entry / (1 << 30)
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in range(2)]
    procs = [
        StageProcess(
            ["encoder", "--model", str(model_dir()), "--bind", a, "--encoder-cache-gb", f"{gib:.12f}"]
        )
        for a in addresses
    ]
    replicas = ReplicaSet(ctx, addresses, "encoder")
    try:
        await _wait_up(replicas, procs)
        clients = [replicas.replicas[a].client for a in addresses]
        turn = itertools.cycle(clients)
        hits = total = 0
        order = np.random.default_rng(5)
        for n in range(PASSES + 1):
            # Requests come back in another order each pass (a fixed cycle would line round-robin
            # up with the working set and make it a static shard by accident).
            for i in order.permutation(len(images)):
                key, pixels = images[i]
                client = replicas.owner(key).client if name == "rendezvous" else next(turn)
                hit = await _one(client, key, pixels)
                if n > 0:  # the first pass only fills the caches
                    hits, total = hits + hit, total + 1
        await replicas.ping_all()
        infos = [r.pong.info for r in replicas.replicas.values()]
        counted = sum(i["cache_hits"] for i in infos)
        # NOTE: the replicas' own counters agree with the client (warm-up pass hits included).
        assert counted >= hits, (counted, hits)
        rate = hits / total
        per = ", ".join(f"{i['cache_entries']} entries" for i in infos)
        say(f"  {name}: hit rate {rate:.3f} over {total} lookups ({per}, capacity {capacity} each)")
        return rate, {"hits": hits, "lookups": total}
    finally:
        replicas.close()
        for p in procs:
            p.stop()


async def _run(quick: bool) -> list[Result]:
    capacity = QUICK_CAPACITY if quick else CAPACITY
    images = _images(int(WORKING_SET * capacity))
    ctx = zmq.asyncio.Context()
    try:
        entry = await _entry_bytes(ctx)
        say(f"  one cached image: {entry} bytes; C = {capacity} images; working set {len(images)} images")
        rv, rv_details = await _policy(ctx, "rendezvous", capacity, entry, images)
        rr, rr_details = await _policy(ctx, "round-robin", capacity, entry, images)
    finally:
        ctx.destroy(linger=0)
    note = f"2 replicas, C={capacity}, working set 1.8C, {PASSES} replays"
    return [
        Result("encoder_rendezvous_hit_rate", "encoder hit rate, rendezvous", rv, RENDEZVOUS_GOAL,
               unit="", note=note, details=rv_details),
        Result("encoder_round_robin_hit_rate", "encoder hit rate, round-robin", rr, ROUND_ROBIN_GOAL,
               higher_is_better=False, unit="", note=note, details=rr_details),
    ]  # fmt: skip


def run(quick: bool = False) -> list[Result]:
    return asyncio.run(_run(quick))


if __name__ == "__main__":
    main(run, __doc__)
