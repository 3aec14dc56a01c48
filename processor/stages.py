"""Clients for the encoder and LLM stage replicas: discovery, routing and health."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import zmq

from mmcache.shared.block_hash import block_hashes, root_hash
from mmcache.shared.discovery import PING_TIMEOUT, Replica, ReplicaSet, Resolver, dns_resolve
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import Pong, ProbeReply, ProbeRequest, ReleaseProbe
from mmcache.shared.routing import weight
from mmcache.shared.rpc import RpcClient

MAX_PROBES = 4  # LLM replicas probed per request; with more, the prompt's rendezvous top four


@dataclass(frozen=True, slots=True)
class Health:
    address: str
    pong: Pong | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """The LLM replica chosen for a request, with what its probe found (a probe that found nothing,
    where none was sent: :meth:`StageClients._alone`)."""

    client: RpcClient
    probe: ProbeReply


class _Clients(Mapping[str, RpcClient]):
    """Encoder clients by address; one dropped since it was chosen raises ConnectionError (503)."""

    def __init__(self, replicas: ReplicaSet):
        self._replicas = replicas

    def __getitem__(self, address: str) -> RpcClient:
        replica = self._replicas.get(address)
        if replica is None:
            raise ConnectionError(f"encoder replica {address} is gone")
        return replica.client

    def __iter__(self) -> Iterator[str]:
        return iter(self._replicas.replicas)

    def __len__(self) -> int:
        return len(self._replicas.replicas)


class StageClients:
    def __init__(
        self,
        ctx: zmq.Context,
        encoders: list[str],
        llms: list[str],
        resolver: Resolver = dns_resolve,
        **timers: float,
    ):
        self.encoder_set = ReplicaSet(ctx, encoders, "encoder", resolver, **timers)
        self.llm_set = ReplicaSet(ctx, llms, "llm", resolver, **timers)
        self.encoders = _Clients(self.encoder_set)
        self._kv_identity: tuple[bytes, int] | None = None
        self.num_unprobed = 0  # requests routed without a probe (see _alone)
        with contextlib.suppress(RuntimeError):  # no loop yet: started by the first request
            asyncio.get_running_loop()
            self.start()

    def start(self) -> None:
        self.encoder_set.start()
        self.llm_set.start()

    async def wait_started(self, timeout: float = 5.0) -> None:
        """Until every stage name has been looked up once (and each replica pinged)."""
        await asyncio.gather(self.encoder_set.wait_started(timeout), self.llm_set.wait_started(timeout))

    def encoder_for(self, chunk_key: bytes) -> str:
        """The address of the encoder replica that owns ``chunk_key`` (rendezvous over live ids)."""
        self.start()
        return self.encoder_set.owner(chunk_key).address

    def encoder_timeout(self, address: str, timeout: float) -> float:
        """``timeout``, or a ping's for an encoder not answering the heartbeat (routed to only
        when none does): a request to a tier that is all gone ends soon."""
        replica = self.encoder_set.get(address)
        return timeout if replica is not None and replica.alive else min(timeout, PING_TIMEOUT)

    async def kv_identity(self, timeout: float) -> tuple[bytes, int] | None:
        """(model fingerprint, block size) of the LLM replicas, learned once from a Pong."""
        if self._kv_identity is None:
            for replica in self.llm_set.live():
                if replica.pong is None:
                    await self.llm_set.ping(replica, timeout)
                if replica.pong is not None:
                    pong = replica.pong
                    self._kv_identity = (pong.fingerprint, pong.block_size)
                    break
        return self._kv_identity

    async def route(self, probe: ProbeRequest, timeout: float) -> Route:
        """Probe the LLM replicas (at most :data:`MAX_PROBES`: the prompt's rendezvous top ones);
        take the most cached full blocks, then the lightest load, then the replica the prompt's
        first block hashes to (shared.routing). (A replica that shares only the start of a
        block, such as a chat template's first tokens, has no real lead.)"""
        self.start()
        alone = self._alone(probe)
        if alone is not None:
            return alone
        identity = await self.kv_identity(timeout)
        if identity is not None:
            fp, size = identity
            hashes = block_hashes(
                probe.prompt_token_ids, probe.spans, size, root_hash(Fingerprint(fp), probe.salt)
            )
            probe = dataclasses.replace(probe, block_size=size, block_hashes=hashes)
        affinity = probe.block_hashes[0] if probe.block_hashes else probe.prompt_token_ids.numpy().tobytes()
        # NOTE: the same prompt ranks the replicas alike in every processor, so a conversation's
        # probes keep reaching the replica that holds its prefix.
        chosen = self.llm_set.ranked(affinity)[:MAX_PROBES]
        if not chosen:
            raise ConnectionError("no LLM replica found")
        replies = await asyncio.gather(
            *(self._probe(r, probe, timeout) for r in chosen), return_exceptions=True
        )
        live: list[tuple[Replica, ProbeReply]] = []
        for replica, reply in zip(chosen, replies, strict=True):
            if isinstance(reply, ProbeReply):
                live.append((replica, reply))
            else:
                self.llm_set.suspect(replica.address)
        if not live:
            errors = [r for r in replies if isinstance(r, BaseException)]
            raise errors[0] if errors else ConnectionError("no LLM replica")
        size = max(probe.block_size, 1)
        best, reply = max(
            live,
            key=lambda rr: (
                rr[1].cached_tokens // size,
                rr[1].stored_tokens // size,  # with the shared KV tier: what a replica can read
                -rr[1].load,
                weight(rr[0].name, affinity),
            ),
        )
        for other, other_reply in live:
            if other is not best and other_reply.probe_id:
                await other.client.notify(ReleaseProbe(other_reply.probe_id))
        return Route(best.client, reply)

    def _alone(self, probe: ProbeRequest) -> Route | None:
        """The route without a probe where its answer could change nothing: one LLM replica, alive,
        and a prompt without media (no replica to choose, no chunk whose encoding a cached prefix
        could spare). The request's own admission matches its prefix as a probe would have, with
        no time between for the blocks to go; the context length comes from the heartbeat."""
        if probe.spans:
            return None
        live = self.llm_set.live()
        if len(live) != 1 or not live[0].alive or live[0].pong is None or not live[0].pong.max_model_len:
            return None
        pong = live[0].pong
        self.num_unprobed += 1
        return Route(live[0].client, ProbeReply(0, 0, pong.load, pong.max_model_len))

    async def _probe(self, replica: Replica, probe: ProbeRequest, timeout: float) -> ProbeReply:
        """A probe; one to a replica not answering the heartbeat (routed to only when none does)
        waits no longer than a ping, so a request to a tier that is all gone ends soon."""
        if replica.alive:
            return await replica.client.call(probe, timeout=timeout)
        wait = min(timeout, PING_TIMEOUT)
        try:
            # NOTE: wait_for bounds the send too (a DEALER with no peer yet queues it).
            return await asyncio.wait_for(replica.client.call(probe, timeout=wait), wait)
        except TimeoutError as exc:
            raise ConnectionError(f"LLM replica {replica.address} does not answer") from exc

    async def health(self, timeout: float = 2.0) -> tuple[list[Health], list[Health]]:
        """Ping every replica known now (the results feed discovery too)."""
        self.start()

        async def one(replicas: ReplicaSet) -> list[Health]:
            known = list(replicas.replicas.values())
            errors = await asyncio.gather(*(replicas.ping(r, timeout) for r in known))
            pairs = zip(known, errors, strict=True)
            return [Health(r.address, r.pong if e is None else None, e) for r, e in pairs]

        enc, llm = await asyncio.gather(one(self.encoder_set), one(self.llm_set))
        return enc, llm

    def close(self) -> None:
        self.encoder_set.close()
        self.llm_set.close()
