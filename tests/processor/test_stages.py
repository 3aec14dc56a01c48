"""StageClients.route with many LLM replicas: bounded fan-out (at most MAX_PROBES probes), the
same rendezvous-chosen replicas for the same prompt in every processor, the longest cached
prefix among them wins, and the probes not taken are released."""

from __future__ import annotations

import asyncio

import torch
import zmq.asyncio

from mmcache.harness import free_port
from mmcache.processor.stages import MAX_PROBES, StageClients
from mmcache.shared.discovery import tcp_address
from mmcache.shared.messages import Pong, ProbeReply, ProbeRequest, ReleaseProbe
from tests.fake_replica import FakeReplica

FAST = {"resolve_every": 0.2, "heartbeat_every": 0.1, "ping_timeout": 0.5}


class FakeLLM(FakeReplica):
    """An LLM replica answering Ping (with its id) and probes, recording what it was sent."""

    def __init__(self, ctx, ip: str, port: int, rid: str, cached: int = 0):
        self.id, self.cached, self.probes, self.released = rid, cached, 0, []
        super().__init__(ctx, tcp_address(ip, port), Pong("llm", "m", b"fp", block_size=16, id=rid), rid)

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
