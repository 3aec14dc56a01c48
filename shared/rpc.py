"""Async request/reply over DEALER↔ROUTER.

A client owns one DEALER socket connected to one server. Every request gets a
request id; its reply queue is registered *before* the request is sent, so a
fast reply can never be lost. A request may have one reply (:meth:`RpcClient.call`)
or a stream of replies ending with one flagged ``final`` (:meth:`RpcClient.stream`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import zmq
import zmq.asyncio

from shared.messages import Abort, ErrorReply
from shared.wire import decode, encode, peek_rid

log = logging.getLogger(__name__)


class _Socket:
    """The one place frames enter and leave a ZeroMQ socket.

    NOTE: every send and receive goes through pyzmq's asyncio layer. Sending on a synchronous
    shadow of the socket looked cheaper, but the asyncio socket then misses readiness changes
    the shadow consumed (ZeroMQ's descriptor is edge-triggered) and a reply can sit unread.
    """

    def __init__(self, sock: zmq.asyncio.Socket):
        self.sock = sock

    async def send(self, frames: list[Any]) -> None:
        await self.sock.send_multipart(frames, copy=False)

    def send_nowait(self, frames: list[Any]) -> None:
        """Best effort, never waits (used while a task is being cancelled)."""
        with contextlib.suppress(zmq.ZMQError):
            sent = self.sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            sent.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def recv(self) -> list[Any]:
        return await self.sock.recv_multipart(copy=False)

    def close(self, linger: int = 0) -> None:
        self.sock.close(linger=linger)


class RemoteError(RuntimeError):
    """The peer answered with :class:`ErrorReply`."""

    def __init__(self, reply: ErrorReply):
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply


class RpcClient:
    """One DEALER socket to one server address."""

    def __init__(self, ctx: zmq.asyncio.Context, address: str, name: str = "rpc"):
        self.address = address
        self._name = name
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        self._sock = _Socket(sock)
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue | asyncio.Future] = {}
        self._reader: asyncio.Task | None = None

    def _ensure_reader(self) -> None:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read_loop())

    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv()
            try:
                msg, env = decode(frames)
            except Exception as exc:  # a bad peer must not stop this client
                log.warning("%s: dropping bad reply from %s: %s", self._name, self.address, exc)
                continue
            waiter = self._queues.get(env.get("rid"))
            if waiter is None:  # a late reply to a request that timed out
                continue
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait((msg, env))
            elif not waiter.done():
                waiter.set_result((msg, env))

    async def _send(self, rid: int, msg: Any) -> None:
        await self._sock.send(encode(msg, {"rid": rid}))

    async def call(self, msg: Any, timeout: float | None = None) -> Any:
        """Send ``msg`` and return its single reply; raises :class:`RemoteError` or ``TimeoutError``."""
        self._ensure_reader()
        rid = next(self._ids)
        waiter: asyncio.Future = asyncio.get_running_loop().create_future()
        self._queues[rid] = waiter  # NOTE: registered before sending, so no reply can be missed
        try:
            await self._send(rid, msg)
            async with asyncio.timeout(timeout):
                reply, env = await waiter
        except BaseException:
            # Timed out or cancelled: tell the server, it may stop working on it.
            self._sock.send_nowait(encode(Abort(rid), {"rid": 0}))
            raise
        finally:
            self._queues.pop(rid, None)
        if not env.get("final", True):  # a stream answered a call: keep the first, stop the rest
            self._sock.send_nowait(encode(Abort(rid), {"rid": 0}))
        if isinstance(reply, ErrorReply):
            raise RemoteError(reply)
        return reply

    def stream(self, msg: Any, timeout: float | None = None) -> _Stream:
        """Send ``msg`` and iterate its replies (``async with client.stream(m) as s: async for r in s``).

        ``timeout`` bounds the wait for each reply. Leaving the block before the final
        reply (break, error, cancellation) sends :class:`Abort` to the server.
        """
        self._ensure_reader()
        return _Stream(self, msg, timeout)

    async def notify(self, msg: Any) -> None:
        """Send a message that expects no reply."""
        await self._send(next(self._ids), msg)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)


class _Stream:
    def __init__(self, client: RpcClient, msg: Any, timeout: float | None):
        self._client = client
        self._msg = msg
        self._timeout = timeout
        self.rid = next(client._ids)
        self._queue: asyncio.Queue = asyncio.Queue()
        self._done = False

    async def __aenter__(self) -> _Stream:
        self._client._queues[self.rid] = self._queue
        await self._client._send(self.rid, self._msg)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._client._queues.pop(self.rid, None)
        if not self._done:
            # NOTE: runs during cancellation too; the abort must not be awaited there.
            self._client._sock.send_nowait(encode(Abort(self.rid), {"rid": 0}))

    def __aiter__(self) -> AsyncIterator[Any]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Any]:
        while not self._done:
            async with asyncio.timeout(self._timeout):
                msg, env = await self._queue.get()
            if env.get("final", True):
                self._done = True
            if isinstance(msg, ErrorReply):
                self._done = True
                raise RemoteError(msg)
            yield msg


class Responder:
    """Sends replies to one request received by :class:`RpcServer`."""

    def __init__(self, server: RpcServer, identity: bytes, rid: int):
        self._server = server
        self.identity = identity
        self.rid = rid

    async def send(self, msg: Any, final: bool = True) -> None:
        frames = encode(msg, {"rid": self.rid, "final": final})
        await self._server.sock.send([self.identity, *frames])


Handler = Callable[[Any, Responder], Awaitable[None]]


class RpcServer:
    """ROUTER socket; each request runs ``handler(msg, responder)`` as its own task."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        handler: Handler,
        name: str = "server",
        inline: tuple[type, ...] = (),
    ):
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        sock.bind(address)
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.sock = _Socket(sock)
        self._handler = handler
        self._name = name
        # NOTE: messages of these types are handled in the receive loop itself (no task): their
        # handlers must not wait on anything but their reply's send.
        self._inline = inline
        self._tasks: set[asyncio.Task] = set()

    async def serve_forever(self) -> None:
        while True:
            frames = await self.sock.recv()
            identity = frames[0].bytes
            try:
                msg, env = decode(frames[1:])
            except Exception as exc:  # nothing a peer sends may stop this loop
                log.warning("%s: bad request: %s", self._name, exc)
                # Answer the request id if the envelope is readable, so the caller fails fast.
                await Responder(self, identity, peek_rid(frames[1:])).send(
                    ErrorReply("bad_message", str(exc), 400)
                )
                continue
            responder = Responder(self, identity, int(env.get("rid", 0)))
            if isinstance(msg, self._inline):
                await self._run(msg, responder)
                continue
            task = asyncio.get_running_loop().create_task(self._run(msg, responder))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: Any, responder: Responder) -> None:
        try:
            await self._handler(msg, responder)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bad request must never take the stage down
            log.exception("%s: handler failed for %s", self._name, type(msg).__name__)
            with contextlib.suppress(Exception):
                await responder.send(ErrorReply("internal", f"{type(exc).__name__}: {exc}", 500))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self.sock.close(linger=0)
