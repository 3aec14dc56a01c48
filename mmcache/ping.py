"""``mmcache ping ADDRESS``: exit 0 when the stage there answers a Ping (container health checks)."""

from __future__ import annotations

import asyncio

import zmq.asyncio

from mmcache.shared.messages import Ping, Pong
from mmcache.shared.rpc import RpcClient


async def _ping(address: str, timeout: float) -> Pong:
    ctx = zmq.asyncio.Context()
    client = RpcClient(ctx, address, "ping")
    try:
        # NOTE: wait_for bounds the send too (it waits while no peer is connected).
        return await asyncio.wait_for(client.call(Ping(), timeout=timeout), timeout)
    finally:
        client.close()
        ctx.destroy(linger=0)


def ping(address: str, timeout: float) -> int:
    try:
        pong = asyncio.run(_ping(address, timeout))
    except Exception as exc:
        print(f"{address}: {type(exc).__name__}: {exc}")
        return 1
    print(f"{address}: {pong.stage} {pong.id} load={pong.load}")
    return 0
