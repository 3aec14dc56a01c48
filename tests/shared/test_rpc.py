"""RpcClient / RpcServer over real zmq.asyncio sockets (inproc, one context per test)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio

from mmcache.shared.messages import Abort, EncodeItem, ErrorReply, Ping
from mmcache.shared.rpc import RemoteError, Responder, RpcClient, RpcServer
from mmcache.shared.wire import PROTOCOL_VERSION, decode, encode, message


@message
@dataclass(frozen=True, slots=True)
class RpcProbe:
    """Test-only request: echo ``value`` after ``delay`` seconds, ``replies`` times (a stream)."""

    value: int
    delay: float = 0.0
    replies: int = 1
    fail: str = ""  # "raise" | "error" | ""
    stall_after: int = 0  # go quiet after this many replies (0: never)


@dataclass
class Harness:
    ctx: zmq.asyncio.Context
    server: RpcServer
    task: asyncio.Task
    received: list[Any] = field(default_factory=list)
    sent_order: list[int] = field(default_factory=list)
    aborted: asyncio.Event = field(default_factory=asyncio.Event)

    def client(self) -> RpcClient:
        return RpcClient(self.ctx, self.server.address, name="test")

    def raw_dealer(self) -> zmq.asyncio.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.server.address)
        return sock


@pytest.fixture
async def rpc():
    ctx = zmq.asyncio.Context()
    harness: Harness | None = None

    async def handler(msg: Any, reply: Responder) -> None:
        assert harness is not None
        harness.received.append(msg)
        if isinstance(msg, Abort):
            harness.aborted.set()
            return
        if isinstance(msg, Ping):
            await reply.send(Ping())
            return
        if msg.fail == "raise":
            raise RuntimeError("handler exploded")
        if msg.fail == "error":
            await reply.send(ErrorReply("not_found", "no such thing", 404))
            return
        for i in range(msg.replies):
            await asyncio.sleep(60 if msg.stall_after and i == msg.stall_after else msg.delay)
            harness.sent_order.append(msg.value)
            await reply.send(RpcProbe(msg.value * 100 + i), final=i == msg.replies - 1)

    server = RpcServer(ctx, f"inproc://rpc-{uuid.uuid4().hex}", handler, name="test-server")
    task = asyncio.get_running_loop().create_task(server.serve_forever())
    harness = Harness(ctx, server, task)
    yield harness
    task.cancel()
    server.close()
    ctx.destroy(linger=0)


async def test_call_and_reply(rpc: Harness):
    client = rpc.client()
    try:
        reply = await client.call(RpcProbe(7), timeout=2)
        assert reply == RpcProbe(700)
        assert rpc.received == [RpcProbe(7)]
    finally:
        client.close()


async def test_tensors_travel_through_sockets(rpc: Harness):
    """A zero-copy tensor frame survives a real socket round trip (inproc)."""
    got: list[torch.Tensor] = []

    async def echo(msg: Any, reply: Responder) -> None:
        got.append(msg.pixels.clone())
        await reply.send(EncodeItem(msg.key, msg.modality, msg.pixels.flip(0).contiguous()))

    server = RpcServer(rpc.ctx, f"inproc://tensor-{uuid.uuid4().hex}", echo)
    task = asyncio.get_running_loop().create_task(server.serve_forever())
    client = RpcClient(rpc.ctx, server.address)
    try:
        pixels = torch.randint(0, 256, (2, 3, 28, 28), dtype=torch.uint8)
        reply = await client.call(EncodeItem(b"k", "video", pixels), timeout=2)
        assert torch.equal(got[0], pixels)
        assert torch.equal(reply.pixels, pixels.flip(0))
    finally:
        client.close()
        task.cancel()
        server.close()


async def test_concurrent_calls_resolve_to_their_own_replies(rpc: Harness):
    client = rpc.client()
    n = 16
    try:
        # Later requests answer sooner, so replies arrive in the reverse order of the requests.
        calls = [client.call(RpcProbe(i, delay=0.03 * (n - i)), timeout=5) for i in range(n)]
        replies = await asyncio.gather(*calls)
        assert [r.value for r in replies] == [i * 100 for i in range(n)]
        assert sorted(rpc.sent_order) == list(range(n))
        assert rpc.sent_order[0] > rpc.sent_order[-1]  # the replies really came out of order
    finally:
        client.close()


async def test_two_clients_do_not_see_each_others_replies(rpc: Harness):
    a, b = rpc.client(), rpc.client()
    try:
        # Both clients number their requests from 1: replies are routed by socket identity.
        ra, rb = await asyncio.gather(
            a.call(RpcProbe(1, delay=0.05), timeout=2), b.call(RpcProbe(2, delay=0.0), timeout=2)
        )
        assert (ra.value, rb.value) == (100, 200)
    finally:
        a.close()
        b.close()


async def test_stream_ends_at_the_final_reply(rpc: Harness):
    client = rpc.client()
    try:
        async with client.stream(RpcProbe(3, replies=4), timeout=2) as replies:
            values = [r.value async for r in replies]
        assert values == [300, 301, 302, 303]
        assert not rpc.aborted.is_set()  # a completed stream sends no Abort
        await asyncio.sleep(0.05)
        assert not any(isinstance(m, Abort) for m in rpc.received)
    finally:
        client.close()


async def test_remote_error_from_error_reply(rpc: Harness):
    client = rpc.client()
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(RpcProbe(1, fail="error"), timeout=2)
        assert info.value.reply == ErrorReply("not_found", "no such thing", 404)
        assert "not_found" in str(info.value)
    finally:
        client.close()


async def test_timeout_is_per_reply(rpc: Harness):
    client = rpc.client()
    try:
        # 6 replies 0.1 s apart: 0.6 s in all, longer than the 0.5 s timeout, but no gap is.
        async with client.stream(RpcProbe(1, delay=0.1, replies=6), timeout=0.5) as replies:
            assert len([r async for r in replies]) == 6
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            await client.call(RpcProbe(2, delay=5), timeout=0.1)
        assert time.monotonic() - start < 1.0
    finally:
        client.close()


async def test_timeout_inside_a_stream_raises_and_aborts(rpc: Harness):
    client = rpc.client()
    try:
        got = []
        with pytest.raises(TimeoutError):
            async with client.stream(RpcProbe(4, replies=5, stall_after=2), timeout=0.5) as replies:
                rid = replies.rid
                async for r in replies:
                    got.append(r.value)
        assert got == [400, 401]
        await asyncio.wait_for(rpc.aborted.wait(), 2)
        assert [m for m in rpc.received if isinstance(m, Abort)] == [Abort(request_id=rid)]
    finally:
        client.close()


async def test_leaving_a_stream_early_sends_abort(rpc: Harness):
    client = rpc.client()
    try:
        async with client.stream(RpcProbe(5, delay=0.01, replies=200), timeout=2) as replies:
            rid = replies.rid
            async for r in replies:
                assert r.value == 500
                break
        await asyncio.wait_for(rpc.aborted.wait(), 2)
        aborts = [m for m in rpc.received if isinstance(m, Abort)]
        assert aborts == [Abort(request_id=rid)]
        # The client still works afterwards (late replies of the aborted stream are dropped).
        assert (await client.call(RpcProbe(6), timeout=2)).value == 600
    finally:
        client.close()


async def test_cancelled_call_sends_abort(rpc: Harness):
    client = rpc.client()
    try:
        task = asyncio.ensure_future(client.call(RpcProbe(8, delay=10), timeout=20))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.wait_for(rpc.aborted.wait(), 2)
        assert next(m for m in rpc.received if isinstance(m, Abort)).request_id == 1
    finally:
        client.close()


async def test_failing_handler_returns_internal_error_and_server_keeps_serving(rpc: Harness):
    client = rpc.client()
    try:
        with pytest.raises(RemoteError) as info:
            await client.call(RpcProbe(1, fail="raise"), timeout=2)
        assert info.value.reply.code == "internal"
        assert info.value.reply.status == 500
        assert "handler exploded" in info.value.reply.message
        assert (await client.call(RpcProbe(2), timeout=2)).value == 200
        assert not rpc.task.done()
    finally:
        client.close()


def _garbage_variants() -> dict[str, list[bytes]]:
    ping = encode(Ping(), {"rid": 9})
    tensor = encode(EncodeItem(b"k", "image", torch.zeros(3, 4)), {"rid": 9})
    tensor_bytes = bytes(memoryview(tensor[2]))

    def header(**changes: Any) -> bytes:
        h = msgpack.unpackb(ping[1], raw=False)
        h.update(changes)
        return msgpack.packb(h, use_bin_type=True)

    bad_shape = msgpack.unpackb(tensor[1], raw=False)
    bad_shape["body"]["pixels"]["__t__"][1] = [-3, -4]  # 12 elements: the byte count still matches
    return {
        "one_frame": [b"\x00\x01garbage"],
        "random_bytes": [b"\xde\xad", b"\xbe\xef", b"\x00"],
        "unknown_type": [b"NoSuchMessage", ping[1]],
        "not_msgpack": [b"Ping", b"\xc1\xc1\xc1"],
        "wrong_version": [b"Ping", header(v=PROTOCOL_VERSION + 1)],
        "missing_tensor_frame": [tensor[0], tensor[1]],
        "truncated_tensor_frame": [tensor[0], tensor[1], tensor_bytes[:-3]],
        "negative_tensor_shape": [tensor[0], msgpack.packb(bad_shape, use_bin_type=True), tensor_bytes],
        "envelope_not_a_map": [b"Ping", header(env=5)],
        "request_id_not_an_int": [b"Ping", header(env={"rid": "abc"})],
    }


@pytest.mark.parametrize("variant", list(_garbage_variants()))
async def test_garbage_gets_bad_message_and_server_keeps_serving(rpc: Harness, variant: str):
    raw = rpc.raw_dealer()
    client = rpc.client()
    try:
        await raw.send_multipart(_garbage_variants()[variant])
        try:
            frames = await asyncio.wait_for(raw.recv_multipart(), 1)
        except TimeoutError:
            died = rpc.task.done() and not rpc.task.cancelled() and rpc.task.exception()
            pytest.fail(f"no ErrorReply; the server loop {'died: ' + repr(died) if died else 'is silent'}")
        reply, _ = decode(frames)
        assert isinstance(reply, ErrorReply)
        assert reply.code == "bad_message" and reply.status == 400
        # Still serving: a normal request on another socket and on the same one.
        assert (await client.call(RpcProbe(1), timeout=2)).value == 100
        await raw.send_multipart(encode(RpcProbe(2), {"rid": 77}))
        reply, env = decode(await asyncio.wait_for(raw.recv_multipart(), 2))
        assert reply.value == 200 and env["rid"] == 77
        assert not rpc.task.done()
    finally:
        raw.close(linger=0)
        client.close()


async def test_notify_delivers_without_a_reply(rpc: Harness):
    client = rpc.client()
    try:
        await client.notify(Abort(request_id=123))
        await asyncio.wait_for(rpc.aborted.wait(), 2)
        assert rpc.received == [Abort(request_id=123)]
    finally:
        client.close()


async def test_socket_loses_nothing_under_backpressure():
    """High-water marks of 1 force every path: sends that would block queue and flush on
    readiness, replies are queued without waiting, and every wake-up drains the socket.
    500 echoes of mixed sizes over tcp must all come back, in order per sender."""
    from mmcache.shared.loop_socket import LoopSocket

    ctx = zmq.Context()
    got: list[bytes] = []
    done = asyncio.Event()

    def echo(frames):
        router.send_nowait([frames[0], frames[1]])

    def collect(frames):
        got.append(frames[0].bytes[:8])
        if len(got) == 500:
            done.set()

    router = LoopSocket(ctx, zmq.ROUTER, echo)
    router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # as RpcServer: full peers make replies wait
    dealer = LoopSocket(ctx, zmq.DEALER, collect)
    for s in (router, dealer):
        s.sock.setsockopt(zmq.SNDHWM, 1)
        s.sock.setsockopt(zmq.RCVHWM, 1)
    port = router.sock.bind_to_random_port("tcp://127.0.0.1")
    dealer.sock.connect(f"tcp://127.0.0.1:{port}")
    router.start()
    try:
        sizes = [8, 300_000, 64, 2_000_000]
        payloads = [i.to_bytes(8, "little") + bytes(sizes[i % 4]) for i in range(500)]
        await asyncio.gather(*(dealer.send([p]) for p in payloads))
        await asyncio.wait_for(done.wait(), 60)
        assert got == [p[:8] for p in payloads]
    finally:
        router.close()
        dealer.close()
        ctx.term()


async def test_a_send_that_consumes_the_readiness_signal_still_delivers():
    """ZeroMQ's descriptor signals changes, and a send reads (clears) that signal: a message that
    arrived just before our send must still be delivered, with nothing else happening after."""
    from mmcache.shared.loop_socket import LoopSocket

    ctx = zmq.Context()
    got: list[bytes] = []
    ours = LoopSocket(ctx, zmq.DEALER, lambda frames: got.append(frames[0].bytes))
    peer = ctx.socket(zmq.DEALER)
    port = peer.bind_to_random_port("tcp://127.0.0.1")
    ours.sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        await ours.send([b"hello"])
        assert peer.recv() == b"hello"  # connected both ways
        await asyncio.sleep(0.1)  # the loop has settled: nothing pending
        peer.send(b"for you")
        time.sleep(0.2)  # it arrives and signals the descriptor, while the loop does not turn
        await ours.send([b"again"])  # this send processes ZeroMQ's commands: the signal is gone
        deadline = time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert got == [b"for you"]
    finally:
        ours.close()
        peer.close(linger=0)
        ctx.term()


async def test_a_peer_that_stops_reading_holds_up_only_its_own_replies():
    """Two peers of one ROUTER; one never reads (its queue fills): replies to the other still flow."""
    from mmcache.shared.loop_socket import LoopSocket

    ctx = zmq.Context()
    router = LoopSocket(ctx, zmq.ROUTER, lambda frames: None)
    router.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.sock.setsockopt(zmq.SNDHWM, 2)
    port = router.sock.bind_to_random_port("tcp://127.0.0.1")
    stuck, live = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
    for sock, name in ((stuck, b"stuck"), (live, b"live")):
        sock.setsockopt(zmq.IDENTITY, name)
        sock.setsockopt(zmq.RCVHWM, 2)
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send(b"hello")  # the router learns the identity
    try:
        router.start()
        await asyncio.sleep(0.3)
        for _ in range(200):  # far more than the stuck peer's pipes hold
            router.send_nowait([b"stuck", b"x" * 100_000])
        assert router._queued.get(b"stuck")  # the rest waits in its own queue ...
        for i in range(5):
            router.send_nowait([b"live", str(i).encode()])
        got = []
        deadline = time.monotonic() + 5
        while len(got) < 5 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
            with contextlib.suppress(zmq.Again):
                got.append(live.recv(zmq.NOBLOCK))
        assert got == [b"0", b"1", b"2", b"3", b"4"]  # ... and the live peer is not held up
    finally:
        router.close()
        stuck.close(linger=0)
        live.close(linger=0)
        ctx.term()


async def test_closing_a_client_ends_its_waiting_calls_and_streams_with_503(rpc: Harness):
    """Discovery closes the client of a replica that went away: what waited on it fails now."""
    client = rpc.client()
    call = asyncio.create_task(client.call(RpcProbe(1, delay=30), timeout=60))

    async def read_stream():
        async with client.stream(RpcProbe(2, replies=3, stall_after=1), timeout=60) as replies:
            return [r async for r in replies]

    stream = asyncio.create_task(read_stream())
    await asyncio.sleep(0.3)
    started = time.monotonic()
    client.close()
    for task in (call, stream):
        with pytest.raises(RemoteError) as info:
            await task
        assert info.value.reply.status == 503 and info.value.reply.code == "stage_unavailable"
    assert time.monotonic() - started < 5
