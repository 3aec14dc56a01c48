"""A client notices at once that its server went away (real TCP on loopback): what waits ends
with a 503, the owner is told, new calls fail fast, and all is well again once it is back."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq

from mmcache.harness import free_port
from shared.messages import Ping, Pong
from shared.rpc import RemoteError, RpcClient
from tests.fake_replica import FakeReplica


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
