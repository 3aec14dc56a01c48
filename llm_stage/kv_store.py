"""The connection to the shared KV store (Redis protocol: Redis or Valkey), and when to leave it be.

Reads run on the event loop (``redis.asyncio``), each bounded by ``timeout``; writes run on the
KV tier's writer thread (a blocking client with the same socket timeouts). After a failure the
store counts as down for :data:`RETRY_SECONDS`: reads and writes skip it meanwhile, so a dead or
unreachable store costs each request nothing, not one timeout each.
"""

from __future__ import annotations

import time
from typing import cast

import redis
import redis.asyncio as aioredis

RETRY_SECONDS = 2.0


class KVStore:
    def __init__(self, url: str, timeout: float):
        self.url = url
        self.timeout = timeout
        self._aio: aioredis.Redis | None = None  # made on the event loop that uses it
        self._sync: redis.Redis | None = None  # the writer thread's
        # NOTE: a float written by either thread and read by both: a stale read only costs one
        # more try or one more skip.
        self._down_until = 0.0
        self.up = True

    def down(self) -> bool:
        return time.monotonic() < self._down_until

    def failed(self) -> None:
        self.up = False
        self._down_until = time.monotonic() + RETRY_SECONDS

    def worked(self) -> None:
        self.up = True

    async def get_many(self, keys: list[str]) -> list[bytes | None]:
        if self._aio is None:
            self._aio = aioredis.Redis.from_url(
                self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout
            )
        # NOTE: no decode_responses: values come back as bytes
        return cast(list[bytes | None], await self._aio.mget(keys))

    async def exists_many(self, keys: list[str]) -> list[int]:
        if self._aio is None:
            self._aio = aioredis.Redis.from_url(
                self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout
            )
        pipe = self._aio.pipeline(transaction=False)
        for key in keys:
            pipe.exists(key)
        return cast(list[int], await pipe.execute())

    def set_many(self, items: list[tuple[str, bytes]]) -> None:
        """Blocking (the writer thread's): one pipelined round trip."""
        if self._sync is None:
            self._sync = redis.Redis.from_url(
                self.url, socket_timeout=self.timeout, socket_connect_timeout=self.timeout
            )
        pipe = self._sync.pipeline(transaction=False)
        for key, value in items:
            pipe.set(key, value)
        pipe.execute()

    def close(self) -> None:
        if self._sync is not None:
            self._sync.close()
