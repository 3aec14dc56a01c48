"""Clients for the encoder and LLM stage replicas, and their health."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass

import zmq.asyncio

from shared.messages import Ping, Pong
from shared.rpc import RpcClient


@dataclass(frozen=True, slots=True)
class Health:
    address: str
    pong: Pong | None
    error: str | None = None


class StageClients:
    def __init__(self, ctx: zmq.asyncio.Context, encoders: list[str], llms: list[str]):
        self.encoders = [RpcClient(ctx, a, "encoder") for a in encoders]
        self.llms = [RpcClient(ctx, a, "llm") for a in llms]
        self._next_encoder = itertools.cycle(self.encoders)
        self._next_llm = itertools.cycle(self.llms)
        self.llm_info: dict[str, Pong] = {}

    def encoder(self) -> RpcClient:
        return next(self._next_encoder)

    def llm(self) -> RpcClient:
        return next(self._next_llm)

    async def ping(self, client: RpcClient, timeout: float) -> Health:
        try:
            pong = await client.call(Ping(), timeout=timeout)
        except TimeoutError:
            return Health(client.address, None, "no answer")
        except Exception as exc:
            return Health(client.address, None, str(exc))
        if client in self.llms:
            self.llm_info[client.address] = pong
        return Health(client.address, pong)

    async def health(self, timeout: float = 2.0) -> tuple[list[Health], list[Health]]:
        enc = [self.ping(c, timeout) for c in self.encoders]
        llm = [self.ping(c, timeout) for c in self.llms]
        results = await asyncio.gather(*enc, *llm)
        return list(results[: len(enc)]), list(results[len(enc) :])

    async def max_model_len(self, client: RpcClient, timeout: float) -> int:
        pong = self.llm_info.get(client.address)
        if pong is None:
            health = await self.ping(client, timeout)
            if health.pong is None:
                raise ConnectionError(f"LLM stage {client.address} does not answer: {health.error}")
            pong = health.pong
        return int(pong.info["max_model_len"])

    def close(self) -> None:
        for client in (*self.encoders, *self.llms):
            client.close()
