"""Replica discovery: one stage address may stand for many replicas.

A target such as ``tcp://encoder:5556`` names a DNS name that resolves to every replica (a
compose service, Swarm's ``tasks.<service>``, a Kubernetes headless Service). A
:class:`ReplicaSet` resolves each target, keeps one client per resolved address, re-resolves
every few seconds (and at once after a failure), pings every replica on a heartbeat, drops the
ones that stop answering and takes back those that answer again.

A replica is known by the id it sends in its :class:`~shared.messages.Pong`, not by the
address it was reached at, so every client (each processor, each LLM replica) computes the same
rendezvous owner whatever name or address it used.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import zmq

from mmcache.shared.messages import Ping, Pong
from mmcache.shared.routing import weight
from mmcache.shared.rpc import RpcClient

log = logging.getLogger(__name__)

Resolver = Callable[[str, int], Awaitable[list[str]]]  # (host, port) -> IP addresses

RESOLVE_EVERY = 3.0  # seconds between DNS lookups of each target (compose/Swarm/k8s scale-ups)
HEARTBEAT_EVERY = 1.0  # seconds between pings of each replica
PING_TIMEOUT = 2.0  # a ping without a Pong in this long is a miss
# Misses in a row before a replica is dropped from routing: 3 s when pings fail at once, about
# 9 s when each waits out PING_TIMEOUT.
MAX_MISSES = 3
MAX_REPLICAS = 256  # resolved addresses kept per set; more are ignored (bounded sockets)


async def dns_resolve(host: str, port: int) -> list[str]:
    """Every address ``host`` resolves to (the system resolver, off the event loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({str(info[4][0]) for info in infos})


def split_target(target: str) -> tuple[str, int] | None:
    """(host, port) of a ``tcp://host:port`` target whose host is a name; None when it needs no
    lookup (an IP literal, ``ipc://``, ``inproc://``)."""
    if not target.startswith("tcp://"):
        return None
    host, sep, port = target[len("tcp://") :].rpartition(":")
    if not sep or not port.isdigit() or host.startswith("["):
        return None
    try:
        socket.inet_pton(socket.AF_INET, host)
        return None
    except OSError:
        return host, int(port)


def tcp_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ":" in ip else f"tcp://{ip}:{port}"


@dataclass(slots=True)
class Replica:
    address: str  # where this client reaches it
    client: RpcClient
    pong: Pong | None = None  # the last one
    misses: int = 0  # pings in a row without an answer
    seen: float = 0.0  # monotonic time of the last Pong

    @property
    def id(self) -> str | None:
        return (self.pong.id or self.address) if self.pong is not None else None

    @property
    def name(self) -> str:
        """What routing weighs: the id, or the address until the first Pong."""
        return self.id or self.address

    @property
    def alive(self) -> bool:
        return self.pong is not None and self.pong.healthy and self.misses < MAX_MISSES


@dataclass(slots=True)
class _Target:
    target: str
    host_port: tuple[str, int] | None
    addresses: list[str] = field(default_factory=list)


class ReplicaSet:
    """The replicas of one stage behind one or more targets, kept current in the background."""

    def __init__(
        self,
        ctx: zmq.Context,
        targets: list[str],
        stage: str,
        resolver: Resolver = dns_resolve,
        resolve_every: float = RESOLVE_EVERY,
        heartbeat_every: float = HEARTBEAT_EVERY,
        ping_timeout: float = PING_TIMEOUT,
    ):
        self._ctx = ctx
        self.stage = stage
        self._resolver = resolver
        self._resolve_every = resolve_every
        self._heartbeat_every = heartbeat_every
        self._ping_timeout = ping_timeout
        self._targets = [_Target(t, split_target(t)) for t in targets]
        self.replicas: dict[str, Replica] = {}  # by address
        for t in self._targets:
            if t.host_port is None:  # NOTE: literal addresses are usable before the first lookup
                t.addresses = [t.target]
                self._add(t.target)
        self._task: asyncio.Task | None = None
        self._wake = asyncio.Event()
        self._last_resolve = -float("inf")
        self._started = asyncio.Event()  # set after the first lookup of every target
        if not any(t.host_port for t in self._targets):
            self._started.set()

    # --- routing ---------------------------------------------------------------------------

    def live(self) -> list[Replica]:
        """Replicas to route to, one per id: those answering the heartbeat. When none does (at
        start-up, or every one is slow), every replica known so far, so a request still tries."""
        alive = [r for r in self.replicas.values() if r.alive]
        known = list(self.replicas.values())
        # NOTE: a replica that said it is unhealthy is never routed to, not even as a last resort.
        healthy = [r for r in known if r.pong is not None and r.pong.healthy]
        pool = alive or healthy or [r for r in known if r.pong is None]
        by_id: dict[str, Replica] = {}
        for r in sorted(pool, key=lambda r: r.address):
            by_id.setdefault(r.name, r)
        return list(by_id.values())

    def ranked(self, key: bytes) -> list[Replica]:
        """Live replicas by rendezvous weight of their id for ``key``, highest first."""
        return sorted(self.live(), key=lambda r: weight(r.name, key), reverse=True)

    def owner(self, key: bytes) -> Replica:
        live = self.live()
        if not live:
            raise ConnectionError(f"no {self.stage} replica found")
        return max(live, key=lambda r: weight(r.name, key))

    def get(self, address: str) -> Replica | None:
        return self.replicas.get(address)

    def suspect(self, address: str | None = None) -> None:
        """A call failed: ping now and look the names up again (do not wait for the timers)."""
        self._last_resolve = -float("inf")
        self._wake.set()

    # --- background ------------------------------------------------------------------------

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def wait_started(self, timeout: float) -> None:
        """Until every name has been looked up once (literal addresses need no lookup)."""
        self.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._started.wait()

    async def _run(self) -> None:
        while True:
            try:
                if time.monotonic() - self._last_resolve >= self._resolve_every:
                    await self.resolve()
                await self.ping_all()
            except asyncio.CancelledError:
                raise
            except Exception:  # discovery must outlive any one bad round
                log.exception("%s discovery round failed", self.stage)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._heartbeat_every):
                    await self._wake.wait()

    async def resolve(self) -> None:
        """Look every name up; connect to new addresses, close those no name gives any more."""
        self._last_resolve = time.monotonic()
        for t in self._targets:
            if t.host_port is None:
                continue
            host, port = t.host_port
            try:
                ips = await self._resolver(host, port)
            except OSError as exc:  # NOTE: keep the last answer; the heartbeat judges those replicas
                log.debug("%s: cannot resolve %s: %s", self.stage, host, exc)
                continue
            t.addresses = [tcp_address(ip, port) for ip in ips]
        self._started.set()
        wanted = {a for t in self._targets for a in t.addresses}
        for address in list(self.replicas):
            if address not in wanted:
                log.info("%s replica %s is gone from its name", self.stage, address)
                self.replicas.pop(address).client.close()
        for address in sorted(wanted):
            if address not in self.replicas and len(self.replicas) < MAX_REPLICAS:
                log.info("%s replica found at %s", self.stage, address)
                self._add(address)

    def _add(self, address: str) -> Replica:
        replica = self.replicas[address] = Replica(address, self._client(address))
        return replica

    def _client(self, address: str) -> RpcClient:
        return RpcClient(self._ctx, address, self.stage, on_lost=lambda: self._lost(address))

    def _lost(self, address: str) -> None:
        """The connection to a replica dropped (it died, or the network between us): out of
        routing now, not after the missed heartbeats; a Pong takes it back."""
        replica = self.replicas.get(address)
        if replica is not None and replica.alive:
            log.warning("%s replica %s lost its connection: dropped", self.stage, address)
            replica.misses = MAX_MISSES
        self.suspect(address)

    async def ping_all(self, timeout: float | None = None) -> None:
        await asyncio.gather(*(self.ping(r, timeout) for r in list(self.replicas.values())))

    async def ping(self, replica: Replica, timeout: float | None = None) -> str | None:
        """Ping one replica and record the outcome; returns the error, None when it answered."""
        timeout = self._ping_timeout if timeout is None else timeout
        try:
            # NOTE: wait_for bounds the send too (a DEALER with no peer yet queues it).
            pong = await asyncio.wait_for(replica.client.call(Ping(), timeout=timeout), timeout)
        except Exception as exc:
            error = "no answer" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        else:
            if isinstance(pong, Pong):
                was_alive = replica.alive
                replica.pong, replica.misses, replica.seen = pong, 0, time.monotonic()
                if not pong.healthy:
                    if was_alive:
                        log.warning(
                            "%s replica %s says it is unhealthy: dropped", self.stage, replica.address
                        )
                    return "unhealthy"
                if not was_alive:
                    log.info("%s replica %s (%s) is up", self.stage, pong.id, replica.address)
                return None
            error = f"unexpected reply {type(pong).__name__}"
        was_alive = replica.alive
        replica.misses += 1
        if was_alive and not replica.alive:
            log.warning("%s replica %s stopped answering: dropped", self.stage, replica.address)
        if replica.misses >= MAX_MISSES and self.replicas.get(replica.address) is replica:
            # A fresh socket: a dead peer's socket would hold every ping sent to it meanwhile.
            replica.client.close()
            replica.client = self._client(replica.address)
        return error

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for replica in self.replicas.values():
            replica.client.close()
        self.replicas.clear()
