"""Stored responses for ``previous_response_id``: bounded (entries and bytes), expiring, salted.

A stored response is its conversation in chat form (every turn but the instructions, which
OpenAI does not carry over), so that the next turn renders the same prompt prefix and hits the
LLM stage's prefix cache. Entries are found only with the ``cache_salt`` they were stored with.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import orjson


@dataclass(frozen=True, slots=True)
class Stored:
    salt: str | None
    messages: list[dict]  # chat-form turns, the answer's assistant turn last
    nbytes: int
    expires: float


class ResponseStore:
    def __init__(
        self, max_entries: int, max_bytes: int, ttl: float, clock: Callable[[], float] = time.monotonic
    ):
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl = ttl
        self._clock = clock
        self._entries: OrderedDict[str, Stored] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, salt: str | None, messages: list[dict]) -> bool:
        """Keep a response (the oldest go to make room); False when it alone is over the bytes."""
        if self.max_entries <= 0:
            return False
        nbytes = len(orjson.dumps(messages))
        if nbytes > self.max_bytes:
            return False
        self._expire()
        self._drop(response_id)
        while self._entries and (
            len(self._entries) >= self.max_entries or self.nbytes + nbytes > self.max_bytes
        ):
            self._drop(next(iter(self._entries)))
        self._entries[response_id] = Stored(salt, messages, nbytes, self._clock() + self.ttl)
        self.nbytes += nbytes
        return True

    def get(self, response_id: str, salt: str | None) -> list[dict] | None:
        """The stored turns, or None: unknown, expired, or stored under another salt.

        NOTE: a wrong salt reads as unknown, so one tenant cannot learn another's ids exist.
        """
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or entry.salt != salt:
            return None
        self._entries.move_to_end(response_id)
        return entry.messages

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.nbytes -= entry.nbytes
