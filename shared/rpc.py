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
from typing import Any, cast

import zmq
from zmq.utils.monitor import parse_monitor_message

from mmcache.shared.loop_socket import LoopSocket
from mmcache.shared.messages import Abort, ErrorReply
from mmcache.shared.wire import decode, encode, peek_rid

log = logging.getLogger(__name__)


class RemoteError(RuntimeError):
    """The peer answered with :class:`ErrorReply`."""

    def __init__(self, reply: ErrorReply):
        super().__init__(f"{reply.code}: {reply.message}")
        self.reply = reply


_monitors = itertools.count()  # names of the clients' monitor sockets


class RpcClient:
    """One DEALER socket to one server address.

    The socket is watched (a ZeroMQ monitor): when its connection drops (the server died: on
    loopback or a LAN the kernel closes the TCP connection at once; it hung or its network was
    cut: the ZMTP heartbeat closes the connection after a few silent seconds), every call and
    stream still waiting ends with a 503 ``stage_unavailable`` there and then, ``on_lost`` is
    told, and new calls fail fast with ``ConnectionError`` until the connection is back (ZeroMQ
    reconnects by itself, and the server greets again), instead of each waiting for its timeout.
    """

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        name: str = "rpc",
        on_lost: Callable[[], None] | None = None,
    ):
        self.address = address
        self._name = name
        self._sock = LoopSocket(ctx, zmq.DEALER, on_message=self._on_reply)
        # NOTE: a plain socket whatever the context's class (as LoopSocket's), read without blocking.
        where = f"inproc://rpc-monitor-{next(_monitors)}"
        # NOTE: back on a finished ZMTP handshake, not a TCP connect: the kernel of a hung peer
        # still accepts connections, but only a live peer greets.
        self._sock.sock.monitor(where, zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        # NOTE: made through the context, so ``ctx.destroy`` closes it even if nobody else does
        # (a socket the context does not know would keep ``term`` waiting forever).
        self._monitor: zmq.Socket | None = ctx.socket(zmq.PAIR, socket_class=zmq.Socket)
        self._monitor.connect(where)
        self._watched: asyncio.AbstractEventLoop | None = None
        self._on_lost = on_lost
        self.lost = False  # the connection dropped and is not back yet
        self._sock.sock.connect(address)
        self._ids = itertools.count(1)
        self._queues: dict[int, asyncio.Queue | asyncio.Future] = {}

    def _watch(self) -> None:
        if self._watched is None and self._monitor is not None:
            self._watched = asyncio.get_running_loop()
            self._watched.add_reader(self._monitor.FD, self._on_monitor)
            self._watched.call_soon(self._on_monitor)  # events may predate the watch

    def _on_monitor(self) -> None:
        # NOTE: like the data socket's, the monitor's descriptor is edge-triggered: drain it all.
        while self._monitor is not None and cast(int, self._monitor.get(zmq.EVENTS)) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))["event"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.lost = False
            elif event == zmq.EVENT_DISCONNECTED and not self.lost:
                self.lost = True
                log.info("%s: connection to %s lost", self._name, self.address)
                self._fail_waiting("lost its connection")
                if self._on_lost is not None:
                    self._on_lost()

    def _fail_waiting(self, why: str) -> None:
        gone = ErrorReply("stage_unavailable", f"{self._name} replica {self.address} {why}", 503)
        for waiter in self._queues.values():
            if isinstance(waiter, asyncio.Queue):
                waiter.put_nowait((gone, {"final": True}))
            elif not waiter.done():
                waiter.set_result((gone, {"final": True}))

    def _on_reply(self, frames: list[Any]) -> None:
        """Hand a reply to the call or stream waiting for its request id (runs in the loop)."""
        try:
            msg, env = decode(frames)
        except Exception as exc:  # a bad peer must not stop this client
            log.warning("%s: dropping bad reply from %s: %s", self._name, self.address, exc)
            return
        waiter = self._queues.get(env.get("rid", 0))
        if waiter is None:  # a late reply to a request that timed out
            return
        if isinstance(waiter, asyncio.Queue):
            waiter.put_nowait((msg, env))
        elif not waiter.done():
            waiter.set_result((msg, env))

    async def _send(self, rid: int, msg: Any) -> None:
        self._watch()
        if self.lost:
            raise ConnectionError(f"{self._name} replica {self.address} is unreachable")
        await self._sock.send(encode(msg, {"rid": rid}))

    async def call(self, msg: Any, timeout: float | None = None) -> Any:
        """Send ``msg`` and return its single reply; raises :class:`RemoteError` or ``TimeoutError``."""
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
        return _Stream(self, msg, timeout)

    async def notify(self, msg: Any) -> None:
        """Send a message that expects no reply."""
        await self._send(next(self._ids), msg)

    def close(self) -> None:
        """Close the socket; calls and streams still waiting end with a 503 (the replica is gone
        to this client), not at their timeout."""
        if self._monitor is not None:
            if self._watched is not None and not self._watched.is_closed():
                self._watched.remove_reader(self._monitor.FD)
            with contextlib.suppress(zmq.ZMQError):
                self._sock.sock.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._sock.close(linger=0)
        self._fail_waiting("is gone")


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
        try:
            await self._client._send(self.rid, self._msg)
        except BaseException:
            self._client._queues.pop(self.rid, None)
            raise
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

    def send_nowait(self, msg: Any, final: bool = True) -> None:
        """Reply without waiting (for quick handlers): sent now, or queued until the peer has room."""
        self._server.sock.send_nowait([self.identity, *encode(msg, {"rid": self.rid, "final": final})])


Handler = Callable[[Any, Responder], Awaitable[None]]
QuickHandler = Callable[[Any, Responder], bool]


class RpcServer:
    """ROUTER socket. Each request first goes to ``quick(msg, responder)``, called as it arrives:
    it answers what it can without waiting (with :meth:`Responder.send_nowait`) and returns
    True; anything else runs ``handler(msg, responder)`` as its own task."""

    def __init__(
        self,
        ctx: zmq.Context,
        address: str,
        handler: Handler,
        name: str = "server",
        quick: QuickHandler | None = None,
    ):
        self.sock = LoopSocket(ctx, zmq.ROUTER, on_message=self._on_request)
        # NOTE: a reply to a peer whose queue is full waits (EAGAIN, queued here) instead of being
        # dropped; one to a peer that is gone fails (EHOSTUNREACH) instead of vanishing.
        self.sock.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.sock.bind(address)
        self.address = self.sock.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._handler = handler
        self._quick = quick
        self._name = name
        self._tasks: set[asyncio.Task] = set()
        self._closed: asyncio.Future | None = None

    async def serve_forever(self) -> None:
        """Serve until :meth:`close` (or cancellation)."""
        self._closed = asyncio.get_running_loop().create_future()
        self.sock.start()
        await self._closed

    def _on_request(self, frames: list[Any]) -> None:
        identity = frames[0].bytes
        try:
            msg, env = decode(frames[1:])
        except Exception as exc:  # nothing a peer sends may stop this server
            log.warning("%s: bad request: %s", self._name, exc)
            # Answer the request id if the envelope is readable, so the caller fails fast.
            Responder(self, identity, peek_rid(frames[1:])).send_nowait(
                ErrorReply("bad_message", str(exc), 400)
            )
            return
        responder = Responder(self, identity, int(env.get("rid", 0)))
        if self._quick is not None:
            try:
                if self._quick(msg, responder):
                    return
            except Exception as exc:  # a bad request must never take the stage down
                log.exception("%s: quick handler failed for %s", self._name, type(msg).__name__)
                responder.send_nowait(ErrorReply("internal", f"{type(exc).__name__}: {exc}", 500))
                return
        task = asyncio.get_running_loop().create_task(self._run(msg, responder))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, msg: Any, responder: Responder) -> None:
        try:
            await self._handler(msg, responder)
        except asyncio.CancelledError:
            raise
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                log.info("%s: the caller of %s is gone", self._name, type(msg).__name__)
            else:
                log.exception("%s: cannot answer %s", self._name, type(msg).__name__)
        except Exception as exc:  # a bad request must never take the stage down
            log.exception("%s: handler failed for %s", self._name, type(msg).__name__)
            with contextlib.suppress(Exception):
                await responder.send(ErrorReply("internal", f"{type(exc).__name__}: {exc}", 500))

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self._closed is not None and not self._closed.done():
            self._closed.set_result(None)
        self.sock.close(linger=0)
