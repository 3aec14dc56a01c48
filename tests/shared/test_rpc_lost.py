"""A client notices at once that its server went away (real TCP on loopback): what waits ends
with a 503, the owner is told, new calls fail fast, and all is well again once it is back."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from mmcache.harness import free_port
from mmcache.shared.discovery import ReplicaSet
from mmcache.shared.loop_socket import heartbeat_timeout_ms
from mmcache.shared.messages import LookupRequest, Ping, Pong
from mmcache.shared.rpc import RemoteError, RpcClient
from tests.fake_replica import FakeReplica

ROOT = Path(__file__).resolve().parents[2]


class Server(FakeReplica):
    """Answers Ping; anything else is never answered (a long generation)."""

    def __init__(self, ctx: zmq.Context, address: str):
        super().__init__(ctx, address, Pong("llm", "m", b"fp"))

    async def handle(self, msg, reply) -> None:
        await asyncio.sleep(3600)


async def test_a_closed_connection_ends_waiting_calls_at_once_and_fails_new_ones_fast():
    ctx = zmq.Context()
    address = f"tcp://127.0.0.1:{free_port()}"
    server = Server(ctx, address)
    lost = []
    client = RpcClient(ctx, address, "llm", on_lost=lambda: lost.append(time.monotonic()))
    try:
        assert isinstance(await client.call(Ping(), timeout=5), Pong)
        waiting = asyncio.create_task(client.call(Pong("x", "m", b""), timeout=60))
        async with client.stream(Pong("x", "m", b""), timeout=60) as replies:
            await asyncio.sleep(0.1)
            t0 = time.monotonic()
            server.close()
            with pytest.raises(RemoteError) as streamed:
                async for _ in replies:
                    pass
        with pytest.raises(RemoteError) as called:
            await waiting
        assert time.monotonic() - t0 < 1.0  # not the 60 s timeout
        for exc in (streamed.value, called.value):
            assert exc.reply.code == "stage_unavailable" and exc.reply.status == 503
            assert address in exc.reply.message
        assert len(lost) == 1 and client.lost
        with pytest.raises(ConnectionError):  # fails fast while it is gone
            await client.call(Ping(), timeout=60)

        server = Server(ctx, address)  # back at the same address: ZeroMQ reconnects by itself
        deadline = time.monotonic() + 10
        while client.lost:
            assert time.monotonic() < deadline, "never reconnected"
            await asyncio.sleep(0.05)
        assert isinstance(await client.call(Ping(), timeout=5), Pong)
        assert len(lost) == 1
    finally:
        client.close()
        server.close()
        ctx.destroy(linger=0)


# A server in its own process (to be stopped or wedged): ``-c SERVER address [wedge]``; with
# ``wedge`` its stage loop stops at the first request that is not a Ping.
SERVER = """
import asyncio, sys, time, zmq
from tests.shared.test_rpc_lost import Server
class Wedging(Server):
    def answer(self, msg, reply):
        time.sleep(600)  # the stage loop stops; the process and its ZeroMQ I/O thread go on
        return True
async def main():
    (Wedging if sys.argv[2:] == ["wedge"] else Server)(zmq.Context(), sys.argv[1])
    print("up", flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


async def test_a_hung_server_is_noticed_by_the_heartbeat_and_stays_lost_until_it_greets():
    """SIGSTOP: the process answers nothing, yet its kernel keeps the TCP connection (and
    accepts new ones). The ZMTP heartbeat closes the connection within seconds; the client
    stays lost while only the kernel answers, and is back once the server runs again."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE, cwd=ROOT)
    ctx = zmq.Context()
    client = RpcClient(ctx, address, "llm")
    try:
        assert proc.stdout.readline() == b"up\n"
        assert isinstance(await client.call(Ping(), timeout=10), Pong)
        async with client.stream(Pong("x", "m", b""), timeout=60) as replies:
            proc.send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            with pytest.raises(RemoteError) as streamed:
                async for _ in replies:
                    pass
        noticed = time.monotonic() - t0
        print(f"hung server noticed after {noticed:.2f} s")
        assert streamed.value.reply.code == "stage_unavailable"
        assert noticed < 4, noticed  # a PING (every 0.25 s) + its timeout (1 s), not the 60 s wait
        await asyncio.sleep(1.5)  # ZeroMQ has reconnected at the TCP level by now
        assert client.lost
        with pytest.raises(ConnectionError):
            await client.call(Ping(), timeout=60)

        proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 15
        while client.lost:
            assert time.monotonic() < deadline, "never greeted again"
            await asyncio.sleep(0.05)
        assert isinstance(await client.call(Ping(), timeout=5), Pong)
    finally:
        client.close()
        ctx.destroy(linger=0)
        proc.send_signal(signal.SIGCONT)
        proc.kill()
        proc.wait()


def test_the_heartbeat_timeout_is_read_from_the_environment(monkeypatch):
    monkeypatch.delenv("MMCACHE_HEARTBEAT_TIMEOUT", raising=False)
    assert heartbeat_timeout_ms() == 1000
    monkeypatch.setenv("MMCACHE_HEARTBEAT_TIMEOUT", "2.5")
    assert heartbeat_timeout_ms() == 2500
    for bad in ("soon", "0", "-1", "1e9"):
        monkeypatch.setenv("MMCACHE_HEARTBEAT_TIMEOUT", bad)
        with pytest.raises(ValueError, match="MMCACHE_HEARTBEAT_TIMEOUT"):
            heartbeat_timeout_ms()


async def test_a_replica_whose_loop_wedges_is_dropped_by_the_heartbeat_and_its_streams_end():
    """The process lives and its ZeroMQ I/O thread answers the ZMTP heartbeat, but its stage loop
    answers nothing: the discovery heartbeat (pings every second, three misses) drops it, and
    the streams waiting on it end with a 503 then (the processor moves them), not at their
    timeout."""
    address = f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", SERVER, address, "wedge"], stdout=subprocess.PIPE, cwd=ROOT
    )
    ctx = zmq.Context()
    replicas = ReplicaSet(ctx, [address], "llm")
    try:
        assert proc.stdout.readline() == b"up\n"
        replicas.start()
        await replicas.wait_started(5)
        deadline = time.monotonic() + 10
        while not replicas.live() or replicas.live()[0].pong is None:
            assert time.monotonic() < deadline, "never answered a ping"
            await asyncio.sleep(0.05)
        client = replicas.live()[0].client
        t0 = time.monotonic()
        with pytest.raises(RemoteError) as streamed:
            async with client.stream(LookupRequest([]), timeout=60) as replies:
                async for _ in replies:
                    pass
        noticed = time.monotonic() - t0
        print(f"wedged replica dropped and its stream ended after {noticed:.1f} s")
        assert streamed.value.reply.code == "stage_unavailable"
        assert noticed < 20, noticed  # three missed pings (2 s each, a second apart), not 60 s
        assert not client.lost  # the connection itself never dropped: the heartbeat found it
        assert not any(r.alive for r in replicas.replicas.values())
    finally:
        replicas.close()
        proc.kill()
        ctx.destroy(linger=0)
