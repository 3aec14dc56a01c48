"""Replica discovery on loopback: replicas bound to 127.0.0.2, 127.0.0.3, ... behind names whose
answers the test controls, two clients reaching them by different names, requests flowing while a
replica is added, one dies and comes back, and one is removed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
import time

import pytest
import zmq.asyncio

from mmcache import harness
from mmcache.shared.discovery import ReplicaSet, split_target, tcp_address
from mmcache.shared.messages import LookupReply, LookupRequest, Pong
from mmcache.shared.routing import rendezvous
from mmcache.shared.rpc import RemoteError
from tests.fake_replica import FakeReplica

FAST = {"resolve_every": 0.2, "heartbeat_every": 0.1, "ping_timeout": 0.5}


class Replica(FakeReplica):
    """An encoder replica that answers Ping with its own id and records the keys it is asked."""

    def __init__(self, ctx: zmq.asyncio.Context, ip: str, port: int, rid: str):
        self.ip, self.id, self.keys = ip, rid, []
        super().__init__(ctx, tcp_address(ip, port), Pong("encoder", "m", b"fp", id=rid), rid)

    def answer(self, msg, reply) -> bool:
        if isinstance(msg, LookupRequest):
            self.keys += msg.keys
            reply.send_nowait(LookupReply([]))
            return True
        return False


class Names:
    """The test's DNS: name -> IPs (one name answers in reverse order, as DNS round-robin may)."""

    def __init__(self):
        self.ips: list[str] = []

    async def resolve(self, host: str, port: int) -> list[str]:
        if host == "encoders":
            return list(self.ips)
        if host == "tasks.encoders":
            return list(reversed(self.ips))
        raise socket.gaierror(socket.EAI_NONAME, "unknown name")


def free_port() -> int:
    """A port free on 127.0.0.2 (the other loopback addresses very likely have it free too)."""
    return harness.free_port("127.0.0.2")


async def until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def live_ids(rs: ReplicaSet) -> set[str]:
    return {r.id for r in rs.replicas.values() if r.alive}


def test_split_target():
    assert split_target("tcp://encoder:5556") == ("encoder", 5556)
    assert split_target("tcp://tasks.llm:5557") == ("tasks.llm", 5557)
    assert split_target("tcp://127.0.0.1:5556") is None  # a literal needs no lookup
    assert split_target("tcp://[::1]:5556") is None
    assert split_target("ipc:///tmp/x.sock") is None
    assert tcp_address("::1", 9) == "tcp://[::1]:9"


@pytest.fixture
async def ctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def test_clients_agree_on_owners_while_replicas_come_and_go(ctx):
    port, names = free_port(), Names()
    replicas = {ip: Replica(ctx, ip, port, f"enc-{ip}") for ip in ("127.0.0.2", "127.0.0.3")}
    names.ips = list(replicas)
    clients = [
        ReplicaSet(ctx, [f"tcp://encoders:{port}"], "encoder", names.resolve, **FAST),
        ReplicaSet(ctx, [f"tcp://tasks.encoders:{port}"], "encoder", names.resolve, **FAST),
    ]
    keys = [i.to_bytes(4, "big") * 4 for i in range(64)]
    sent: list[tuple[str, bytes]] = []  # (replica address, key), every request of both clients
    stop = asyncio.Event()

    async def traffic(rs: ReplicaSet) -> None:
        for key in itertools.islice(itertools.cycle(keys), 20_000):  # bounded, stopped far earlier
            if stop.is_set():
                return
            owner = rs.owner(key)
            sent.append((owner.address, key))
            # A replica going away fails the calls it had (503 RemoteError), not the loop.
            with contextlib.suppress(TimeoutError, ConnectionError, RemoteError):
                await owner.client.call(LookupRequest([key]), timeout=1.0)
            await asyncio.sleep(0.002)

    def agreed(ids: set[str]) -> bool:
        return all(live_ids(rs) == ids for rs in clients)

    def owners(rs: ReplicaSet) -> list[str]:
        return [rs.owner(k).id for k in keys]

    try:
        for rs in clients:
            await rs.wait_started(5.0)
        await until(lambda: agreed({"enc-127.0.0.2", "enc-127.0.0.3"}))
        flows = [asyncio.create_task(traffic(rs)) for rs in clients]

        # Scale up: a third replica appears behind the names; both clients take it in.
        replicas["127.0.0.4"] = Replica(ctx, "127.0.0.4", port, "enc-127.0.0.4")
        names.ips.append("127.0.0.4")
        await until(lambda: agreed({r.id for r in replicas.values()}))
        ids = sorted(r.id for r in replicas.values())
        assert owners(clients[0]) == owners(clients[1]) == [rendezvous(k, ids) for k in keys]
        await until(lambda: len(replicas["127.0.0.4"].keys) > 0)  # the new replica gets its shard

        # A replica stops answering but its name stays: the heartbeat drops it, then takes it back.
        replicas["127.0.0.3"].close()
        await until(lambda: agreed({"enc-127.0.0.2", "enc-127.0.0.4"}))
        assert owners(clients[0]) == owners(clients[1])
        assert "enc-127.0.0.3" not in owners(clients[0])
        replicas["127.0.0.3"] = Replica(ctx, "127.0.0.3", port, "enc-127.0.0.3")
        await until(lambda: agreed({r.id for r in replicas.values()}))
        await until(lambda: len(replicas["127.0.0.3"].keys) > 0)

        # Scale down: one leaves the names and stops.
        gone = replicas.pop("127.0.0.2")
        names.ips.remove("127.0.0.2")
        gone.close()
        await until(lambda: all(f"tcp://127.0.0.2:{port}" not in rs.replicas for rs in clients))
        mark = len(sent)
        await until(lambda: len(sent) > mark + 50)  # requests keep flowing, none to the removed one
        assert all(address != f"tcp://127.0.0.2:{port}" for address, _ in sent[mark:])
        ids = sorted(r.id for r in replicas.values())
        assert owners(clients[0]) == owners(clients[1]) == [rendezvous(k, ids) for k in keys]
        stop.set()
        await asyncio.gather(*flows)
        # Each replica was asked only for keys it owned when asked (modulo the few requests
        # in flight across a change): its shard, not a spread.
        final = {k: rendezvous(k, ids) for k in keys}
        for r in replicas.values():
            late = r.keys[-20:]
            assert sum(final[k] == r.id for k in late) >= 15, r.id
    finally:
        stop.set()
        for rs in clients:
            rs.close()
        for r in replicas.values():
            r.close()


async def test_one_replica_reached_by_two_addresses_counts_once(ctx):
    port = free_port()
    replica = Replica(ctx, "127.0.0.2", port, "only-one")
    replica.server.sock.sock.bind(f"tcp://127.0.0.3:{port}")  # one process, two addresses
    both = [f"tcp://127.0.0.2:{port}", f"tcp://other-name:{port}"]

    async def localhost(host: str, port: int) -> list[str]:
        return ["127.0.0.3"]

    rs = ReplicaSet(ctx, both, "encoder", localhost, **FAST)
    try:
        rs.start()
        await until(lambda: len(rs.replicas) == 2 and all(r.alive for r in rs.replicas.values()))
        assert [r.id for r in rs.live()] == ["only-one"]
    finally:
        rs.close()
        replica.close()


async def test_unresolvable_name_fails_clearly_and_literal_works_before_any_lookup(ctx):
    port = free_port()
    replica = Replica(ctx, "127.0.0.2", port, "lit")
    names = Names()
    by_name = ReplicaSet(ctx, [f"tcp://nowhere:{port}"], "encoder", names.resolve, **FAST)
    literal = ReplicaSet(ctx, [f"tcp://127.0.0.2:{port}"], "encoder", names.resolve, **FAST)
    try:
        await by_name.wait_started(5.0)
        with pytest.raises(ConnectionError, match="no encoder replica"):
            by_name.owner(b"k")
        # No heartbeat has run yet: the literal address is tried anyway.
        reply = await literal.owner(b"k").client.call(LookupRequest([b"k"]), timeout=5.0)
        assert reply.missing == [] and replica.keys == [b"k"]
    finally:
        by_name.close()
        literal.close()
        replica.close()
