"""Clients for the encoder and LLM stage replicas: routing and health."""

from __future__ import annotations

import asyncio
import dataclasses
from dataclasses import dataclass

import zmq

from shared.block_hash import block_hashes, root_hash
from shared.keys import Fingerprint
from shared.messages import Ping, Pong, ProbeReply, ProbeRequest, ReleaseProbe
from shared.routing import rendezvous, weight
from shared.rpc import RpcClient


@dataclass(frozen=True, slots=True)
class Health:
    address: str
    pong: Pong | None
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Route:
    """The LLM replica chosen for a request, with what its probe found."""

    client: RpcClient
    probe: ProbeReply


class StageClients:
    def __init__(self, ctx: zmq.Context, encoders: list[str], llms: list[str]):
        self.encoders = {a: RpcClient(ctx, a, "encoder") for a in encoders}
        self.llms = [RpcClient(ctx, a, "llm") for a in llms]
        self._kv_identity: tuple[bytes, int] | None = None

    def encoder_for(self, chunk_key: bytes) -> str:
        """The encoder replica that owns ``chunk_key`` (rendezvous hashing)."""
        return rendezvous(chunk_key, list(self.encoders))

    async def kv_identity(self, timeout: float) -> tuple[bytes, int] | None:
        """(model fingerprint, block size) of the LLM replicas, learned once from a Pong."""
        if self._kv_identity is None:
            for client in self.llms:
                health = await self.ping(client, timeout)
                if health.pong is not None:
                    self._kv_identity = (health.pong.fingerprint, health.pong.block_size)
                    break
        return self._kv_identity

    async def route(self, probe: ProbeRequest, timeout: float) -> Route:
        """Probe every LLM replica; take the most cached full blocks, then the lightest load, then
        the replica the prompt's first block hashes to (shared.routing). (A replica that shares
        only the start of a block, such as a chat template's first tokens, has no real lead.)"""
        identity = await self.kv_identity(timeout)
        if identity is not None:
            fp, size = identity
            hashes = block_hashes(
                probe.prompt_token_ids, probe.spans, size, root_hash(Fingerprint(fp), probe.salt)
            )
            probe = dataclasses.replace(probe, block_size=size, block_hashes=hashes)
        replies = await asyncio.gather(
            *(c.call(probe, timeout=timeout) for c in self.llms), return_exceptions=True
        )
        live = [(c, r) for c, r in zip(self.llms, replies, strict=True) if isinstance(r, ProbeReply)]
        if not live:
            errors = [r for r in replies if isinstance(r, BaseException)]
            raise errors[0] if errors else ConnectionError("no LLM replica")
        affinity = probe.block_hashes[0] if probe.block_hashes else probe.prompt_token_ids.numpy().tobytes()
        size = max(probe.block_size, 1)
        client, best = max(
            live, key=lambda cr: (cr[1].cached_tokens // size, -cr[1].load, weight(cr[0].address, affinity))
        )
        for other, reply in live:
            if other is not client and reply.probe_id:
                await other.notify(ReleaseProbe(reply.probe_id))
        return Route(client, best)

    async def ping(self, client: RpcClient, timeout: float) -> Health:
        try:
            return Health(client.address, await client.call(Ping(), timeout=timeout))
        except TimeoutError:
            return Health(client.address, None, "no answer")
        except Exception as exc:
            return Health(client.address, None, str(exc))

    async def health(self, timeout: float = 2.0) -> tuple[list[Health], list[Health]]:
        enc = [self.ping(c, timeout) for c in self.encoders.values()]
        llm = [self.ping(c, timeout) for c in self.llms]
        results = await asyncio.gather(*enc, *llm)
        return list(results[: len(enc)]), list(results[len(enc) :])

    def close(self) -> None:
        for client in (*self.encoders.values(), *self.llms):
            client.close()
