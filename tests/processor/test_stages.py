"""StageClients.route with many LLM replicas: bounded fan-out (at most MAX_PROBES probes), the
same rendezvous-chosen replicas for the same prompt in every processor, the longest cached
prefix among them wins, and the probes not taken are released. With one replica, a prompt
without media is routed without a probe (its answer could change nothing); one with media is
still probed."""

from __future__ import annotations

import asyncio

import torch
import zmq.asyncio

from mmcache.harness import free_port
from mmcache.processor.stages import MAX_PROBES, StageClients
from mmcache.shared.discovery import tcp_address
from mmcache.shared.messages import MediaSpan, Pong, ProbeReply, ProbeRequest, ReleaseProbe
from tests.fake_replica import FakeReplica

FAST = {"resolve_every": 0.2, "heartbeat_every": 0.1, "ping_timeout": 0.5}


class FakeLLM(FakeReplica):
    """An LLM replica answering Ping (with its id) and probes, recording what it was sent."""

    def __init__(self, ctx, ip: str, port: int, rid: str, cached: int = 0, max_model_len: int = 4096):
        self.id, self.cached, self.probes, self.released = rid, cached, 0, []
        pong = Pong("llm", "m", b"fp", block_size=16, id=rid, max_model_len=max_model_len)
        super().__init__(ctx, tcp_address(ip, port), pong, rid)

    def answer(self, msg, reply) -> bool:
        if isinstance(msg, ProbeRequest):
            self.probes += 1
            reply.send_nowait(ProbeReply(self.cached, probe_id=7, load=0, max_model_len=4096))
        elif isinstance(msg, ReleaseProbe):
            self.released.append(msg.probe_id)
        else:
            return False
        return True


async def test_many_llm_replicas_get_a_bounded_stable_fan_out():
    ctx = zmq.asyncio.Context()
    port = free_port("127.0.0.2")
    ips = [f"127.0.0.{i}" for i in range(2, 9)]  # 7 replicas behind one name
    llms = {ip: FakeLLM(ctx, ip, port, f"llm-{ip}") for ip in ips}

    async def names(host: str, p: int) -> list[str]:
        return ips if host == "llm" else ["127.0.0.1"]

    processors = [
        StageClients(ctx, [f"tcp://127.0.0.1:{port}"], [f"tcp://llm:{port}"], names, **FAST) for _ in range(2)
    ]
    try:
        for stages in processors:
            await stages.wait_started(5.0)
            deadline = asyncio.get_running_loop().time() + 10
            while sum(r.alive for r in stages.llm_set.replicas.values()) < len(ips):
                assert asyncio.get_running_loop().time() < deadline
                await asyncio.sleep(0.05)
        probe = ProbeRequest(torch.arange(64, dtype=torch.int32), [])
        probed = []
        for stages in processors:
            before = {ip: llm.probes for ip, llm in llms.items()}
            await stages.route(probe, timeout=5.0)
            probed.append({ip for ip, llm in llms.items() if llm.probes > before[ip]})
        assert len(probed[0]) == MAX_PROBES  # bounded fan-out ...
        assert probed[0] == probed[1]  # ... and the same replicas from every processor

        # Among the probed, the one with the longest cached prefix wins; the others' pins go.
        best = sorted(probed[0])[1]
        llms[best].cached = 48
        route = await processors[0].route(probe, timeout=5.0)
        assert route.client.address == tcp_address(best, port)
        assert route.probe.cached_tokens == 48
        await asyncio.sleep(0.2)
        assert all(llms[ip].released for ip in probed[0] - {best})
    finally:
        for stages in processors:
            stages.close()
        for llm in llms.values():
            llm.close()
        ctx.destroy(linger=0)


async def _alive(stages: StageClients, count: int) -> None:
    await stages.wait_started(5.0)
    deadline = asyncio.get_running_loop().time() + 10
    while sum(r.alive for r in stages.llm_set.replicas.values()) < count:
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.05)


async def test_one_replica_takes_a_prompt_without_media_unprobed():
    ctx = zmq.asyncio.Context()
    port = free_port("127.0.0.2")
    llm = FakeLLM(ctx, "127.0.0.2", port, "llm-a", max_model_len=1234)
    stages = StageClients(ctx, ["tcp://127.0.0.1:1"], [tcp_address("127.0.0.2", port)], **FAST)
    text = ProbeRequest(torch.arange(64, dtype=torch.int32), [])
    image = ProbeRequest(torch.arange(64, dtype=torch.int32), [MediaSpan(8, "image", (1, 4, 4), [b"k" * 16])])
    try:
        await _alive(stages, 1)
        route = await stages.route(text, timeout=5.0)
        assert llm.probes == 0 and stages.num_unprobed == 1
        assert route.client.address == tcp_address("127.0.0.2", port)
        assert (route.probe.cached_tokens, route.probe.probe_id, route.probe.max_model_len) == (0, 0, 1234)
        # Media: a cached prefix could spare encoding it, so the replica is asked.
        route = await stages.route(image, timeout=5.0)
        assert llm.probes == 1 and stages.num_unprobed == 1 and route.probe.max_model_len == 4096
    finally:
        stages.close()
        llm.close()
        ctx.destroy(linger=0)


async def test_several_replicas_or_an_untold_context_length_are_probed():
    ctx = zmq.asyncio.Context()
    port = free_port("127.0.0.2")
    quiet = FakeLLM(ctx, "127.0.0.2", port, "llm-a", max_model_len=0)  # a replica that does not say
    text = ProbeRequest(torch.arange(64, dtype=torch.int32), [])
    one = StageClients(ctx, ["tcp://127.0.0.1:1"], [tcp_address("127.0.0.2", port)], **FAST)
    other = FakeLLM(ctx, "127.0.0.3", port, "llm-b")
    two = StageClients(
        ctx, ["tcp://127.0.0.1:1"], [tcp_address("127.0.0.2", port), tcp_address("127.0.0.3", port)], **FAST
    )
    try:
        await _alive(one, 1)
        await one.route(text, timeout=5.0)
        assert quiet.probes == 1 and one.num_unprobed == 0
        await _alive(two, 2)
        await two.route(text, timeout=5.0)
        assert quiet.probes + other.probes == 3 and two.num_unprobed == 0  # both asked: a choice to make
    finally:
        for stages in (one, two):
            stages.close()
        quiet.close()
        other.close()
        ctx.destroy(linger=0)
