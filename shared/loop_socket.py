"""A ZeroMQ socket driven by the asyncio event loop directly: no blocking call, no lost wake-up.

Both ends of :mod:`shared.rpc` (a client's DEALER, a server's ROUTER) send and receive through
:class:`LoopSocket`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, cast

import zmq

log = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT = 1.0  # seconds: a connection on which nothing has arrived this long after a
# ZMTP PING is closed (MMCACHE_HEARTBEAT_TIMEOUT overrides); a PING goes out every quarter of it.
MAX_QUEUED_PER_PEER = 4096  # replies waiting for one peer's room; more are dropped (callers time out)


def heartbeat_timeout_ms() -> int:
    """The heartbeat timeout, from ``MMCACHE_HEARTBEAT_TIMEOUT`` (seconds) or the default.

    NOTE: ZeroMQ counts a frame as traffic only once it has arrived whole, so a link slower than
    (largest frame) / timeout (a 125 MB frame on 1 Gbit/s at 1 s) needs a longer timeout.
    """
    raw = os.environ.get("MMCACHE_HEARTBEAT_TIMEOUT")
    try:
        seconds = HEARTBEAT_TIMEOUT if raw is None else float(raw)
    except ValueError:
        raise ValueError(f"MMCACHE_HEARTBEAT_TIMEOUT={raw!r}: not a number of seconds") from None
    if not 0.2 <= seconds <= 3600:
        raise ValueError(f"MMCACHE_HEARTBEAT_TIMEOUT={raw!r}: must be 0.2 to 3600 seconds")
    return round(seconds * 1000)


class LoopSocket:
    """The one place frames enter and leave a ZeroMQ socket, driven by the event loop directly.

    A plain socket, always used with NOBLOCK, and the loop watching its descriptor. That
    descriptor only signals that the socket's state *changed*, and any call on the socket may
    consume the signal. So the socket is touched only here, and every wake-up and every send
    ends in :meth:`_pump`, which receives while ``EVENTS`` says POLLIN and flushes queued sends
    while it says POLLOUT: a message can never sit unread behind a consumed signal. (pyzmq's
    asyncio layer does the same with a future and a poller registration per message; this is
    one callback per wake-up, and received messages go straight to ``on_message``.)

    Sends that find no room wait in a queue per peer (a ROUTER's first frame names the peer),
    in order, so a peer that stops reading holds up only its own replies.
    """

    def __init__(self, ctx: zmq.Context, kind: int, on_message: Callable[[list[Any]], None]):
        self.sock = zmq.Socket(ctx, kind)
        self.sock.setsockopt(zmq.LINGER, 0)
        # NOTE: a peer that stops answering without closing its connection (hung, stopped, its
        # node cut off the network: no FIN, no RST) would hold every request sent to it until a
        # timeout. ZMTP heartbeats, answered by the peer's I/O thread, close such a connection
        # within about a second, and the socket monitor reports it like any drop.
        timeout_ms = heartbeat_timeout_ms()
        self.sock.setsockopt(zmq.HEARTBEAT_IVL, max(timeout_ms // 4, 50))
        self.sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        self._router = kind == zmq.ROUTER
        self._on_message = on_message  # runs in the loop; must not block
        self._queued: dict[bytes | None, collections.deque[tuple[list[Any], asyncio.Future | None]]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pump_scheduled = False
        self._pumping = False
        self._closed = False

    def start(self) -> asyncio.AbstractEventLoop:
        """Start receiving (in the running loop); sending starts it too."""
        if self._loop is None:
            self._loop = asyncio.get_running_loop()
            self._loop.add_reader(self.sock.FD, self._pump)
            self._pump_soon()  # messages may have arrived before the descriptor was watched
        return self._loop

    def _pump_soon(self) -> None:
        # NOTE: a pump in progress (this call comes from a handler it runs) checks EVENTS again
        # when the handler returns.
        if not self._pump_scheduled and not self._pumping and self._loop is not None:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump)

    def _pump(self) -> None:
        self._pump_scheduled = False
        self._pumping = True
        try:
            self._drain()
        finally:
            self._pumping = False

    def _drain(self) -> None:
        sock = self.sock
        while not self._closed:
            events = cast(int, sock.get(zmq.EVENTS))
            progressed = bool(events & zmq.POLLOUT and self._queued and self._flush())
            if events & zmq.POLLIN:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                progressed = True
                try:
                    self._on_message(frames)
                except Exception:  # keep draining: the next message may be fine
                    log.exception("dropping a message whose handler failed")
            if not progressed:
                return

    def _flush(self) -> bool:
        """Send what queued peers have room for; True if anything left the queues."""
        progressed = False
        for peer in list(self._queued):
            queue = self._queued[peer]
            while queue:
                frames, done = queue[0]
                try:
                    self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
                except zmq.Again:  # still full: its next read signals us
                    break
                except zmq.ZMQError as exc:  # e.g. the peer is gone
                    queue.popleft()
                    if done is not None and not done.done():
                        done.set_exception(exc)
                else:
                    queue.popleft()
                    if done is not None and not done.done():
                        done.set_result(None)
                progressed = True
            if not queue:
                del self._queued[peer]
        return progressed

    def _try_send(self, frames: list[Any]) -> bool:
        """Send now if nothing waits for the same peer and it has room; False: queue it."""
        if self._queued.get(self._peer(frames)):
            return False
        # NOTE: the attempt, sent or not, may have consumed a readiness signal: pump after it.
        self._pump_soon()
        try:
            self.sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def _peer(self, frames: list[Any]) -> bytes | None:
        if not self._router:
            return None
        identity = frames[0]
        return identity if isinstance(identity, bytes) else bytes(identity)

    def _queue(self, frames: list[Any], done: asyncio.Future | None) -> bool:
        queue = self._queued.setdefault(self._peer(frames), collections.deque())
        if done is None and len(queue) >= MAX_QUEUED_PER_PEER:
            log.warning("a peer has not read its last %d replies: dropping one", len(queue))
            return False
        queue.append((frames, done))
        return True

    async def send(self, frames: list[Any]) -> None:
        if self._closed:
            raise ConnectionError("socket closed")
        loop = self.start()
        if not self._try_send(frames):
            done = loop.create_future()
            self._queue(frames, done)
            await done

    def send_nowait(self, frames: list[Any]) -> None:
        """Send, or queue to send as soon as the peer has room; never waits, never raises."""
        if self._closed:
            return
        self.start()
        with contextlib.suppress(zmq.ZMQError):
            if not self._try_send(frames):
                self._queue(frames, None)

    def close(self, linger: int = 0) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.FD)
        for queue in self._queued.values():
            for _, done in queue:
                if done is not None and not done.done():
                    done.set_exception(ConnectionError("socket closed"))
        self._queued.clear()
        self.sock.close(linger=linger)
