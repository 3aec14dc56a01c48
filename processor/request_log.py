"""One record per chat completion: filled in by the handler, logged as one line at INFO and
handed to the metrics when the request ends (:func:`request_middleware`).

The line names the tenant only by a hash of its cache salt: the salt itself scopes every
cache entry of that tenant and must never be written anywhere.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash
from aiohttp import web

from mmcache.processor.errors import APIError

log = logging.getLogger("mmcache.request")

# The endpoints that generate: each request is timed, logged and counted in the metrics.
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/responses"})
CLIENT_CLOSED = 499  # nginx's status for a client that left before the response was complete


@dataclass(slots=True)
class RequestRecord:
    id: str = field(default_factory=lambda: "chatcmpl-" + uuid.uuid4().hex)
    started: float = field(default_factory=time.perf_counter)
    salt_hash: str | None = None
    stream: bool = False
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    mm_cache: dict[str, int] = field(default_factory=dict)
    first_token: float | None = None  # perf_counter when the first content was sent (streaming)
    status: int = 200
    code: str | None = None
    e2e: float = 0.0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.started

    def set_salt(self, salt: str | None) -> None:
        self.salt_hash = None if salt is None else xxhash.xxh3_64_hexdigest(salt.encode())

    def fields(self) -> dict[str, object]:
        """The log line's fields (``extra=``; a JSON log writes them as keys)."""
        ttft = self.ttft
        return {
            "request_id": self.id,
            "status": self.status,
            "code": self.code,
            "salt_hash": self.salt_hash,
            "stream": self.stream,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
            "mm_cache": self.mm_cache,
            "ttft_s": None if ttft is None else round(ttft, 6),
            "e2e_s": round(self.e2e, 6),
        }


RECORD = web.RequestKey("record", RequestRecord)


def request_middleware(on_done: Callable[[RequestRecord], None]):
    """Time each generating request (chat, completions, responses), note how it ended, log it
    and pass it to ``on_done``.

    NOTE: sits inside the error middleware, so it sees an :class:`APIError` before it becomes a
    JSON response (its status and code) and a client that left (the handler is cancelled).
    """

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if request.path not in GENERATION_PATHS:
            return await handler(request)
        record = request[RECORD] = RequestRecord()
        try:
            response = await handler(request)
            record.status = response.status
            return response
        except APIError as exc:
            record.status, record.code = exc.status, exc.code
            raise
        except web.HTTPException as exc:
            record.status = exc.status
            record.code = "request_too_large" if exc.status == 413 else exc.reason.lower().replace(" ", "_")
            raise
        except asyncio.CancelledError:
            record.status, record.code = CLIENT_CLOSED, "client_closed"
            raise
        except Exception:
            record.status, record.code = 500, "internal_error"
            raise
        finally:
            record.e2e = time.perf_counter() - record.started
            log.info("request", extra=record.fields())
            on_done(record)

    return middleware
