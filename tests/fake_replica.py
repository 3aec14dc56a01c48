"""A stage replica stand-in for unit tests: a real ROUTER server (real ZeroMQ, real wire) that
answers Ping with the Pong it is given and anything else as a subclass says."""

from __future__ import annotations

import asyncio

import zmq

from mmcache.shared.messages import Ping, Pong
from mmcache.shared.rpc import Responder, RpcServer


class FakeReplica:
    def __init__(self, ctx: zmq.Context, address: str, pong: Pong, name: str = "test"):
        self.pong = pong
        self.server = RpcServer(ctx, address, self.handle, name, self.quick)
        self.task = asyncio.create_task(self.server.serve_forever())

    def quick(self, msg, reply: Responder) -> bool:
        if isinstance(msg, Ping):
            reply.send_nowait(self.pong)
            return True
        return self.answer(msg, reply)

    def answer(self, msg, reply: Responder) -> bool:
        """A subclass answers here what is not a Ping, as it arrives; False: to :meth:`handle`."""
        return False

    async def handle(self, msg, reply: Responder) -> None:
        raise AssertionError(f"unexpected {msg}")

    def close(self) -> None:  # like a SIGKILL: the kernel closes its TCP connections
        self.server.close()
        self.task.cancel()
