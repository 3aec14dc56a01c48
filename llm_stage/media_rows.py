"""A live request's media rows: the hand-off pins it holds at its encoders, the rows the engine
asks for, and mid-request repair (the processor encodes again the chunks their encoders lost)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from typing import Any

from mmcache.llm_stage.engine import Engine
from mmcache.llm_stage.live import LiveRequest
from mmcache.llm_stage.media_fetch import MediaFetcher
from mmcache.llm_stage.metrics import LLMMetrics
from mmcache.shared.config import LLMConfig
from mmcache.shared.keys import ChunkKey
from mmcache.shared.messages import ErrorReply, NeedEncode, ReleaseHandoff

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any]], asyncio.Task]


class RowSupply:
    """Gets each live request the rows its sequence lacks, and lets its pins go once unneeded.

    ``spawn`` runs a background task the service owns; ``wakeup`` is set whenever the engine
    has news (rows arrived, or a sequence failed)."""

    def __init__(
        self,
        cfg: LLMConfig,
        engine: Engine,
        fetcher: MediaFetcher,
        metrics: LLMMetrics,
        spawn: Spawn,
        wakeup: asyncio.Event,
    ):
        self.cfg = cfg
        self.engine = engine
        self.fetcher = fetcher
        self.metrics = metrics
        self._spawn = spawn
        self._wakeup = wakeup
        self.repairs: Counter[str] = Counter()  # mid-request repairs, by cause (any chunk unreachable)

    def admitted(self, live: LiveRequest) -> None:
        """``live``'s cached prefix is known: chunks wholly inside it need no rows, let their pins go."""
        skipped = [r for r in live.refs if r.end <= live.seq.num_cached_tokens]
        self.fetcher.stats.chunks_skipped += len(skipped)
        self.release_pins(live, [r.key for r in skipped if r.key in live.pinned])

    def release_pins(self, live: LiveRequest, keys: list[ChunkKey]) -> None:
        by_source: dict[str, list[ChunkKey]] = {}
        for r in live.refs:
            if r.key in keys and r.key in live.pinned:
                by_source.setdefault(r.source, []).append(r.key)
        live.pinned.difference_update(keys)
        for source, group in by_source.items():
            self._spawn(self.fetcher.client(source).notify(ReleaseHandoff(list(dict.fromkeys(group)))))

    async def fetch(self, live: LiveRequest, ranges: list[tuple[int, int]]) -> None:
        """Fetch the rows ``live`` lacks; rows gone at their encoders are re-encoded by the
        processor on the live request (a repair), at most ``--max-repairs`` times."""
        seq, rows, todo = live.seq, [], ranges
        started = time.perf_counter()
        try:
            while True:
                result = await self.fetcher.fetch(live.refs, todo, frozenset(live.pinned))
                live.pinned -= result.unpinned
                rows += result.rows
                if not result.lost:
                    break
                if not await self._repair(live, result.lost):
                    return
                todo = [
                    (max(lo, r.start), min(hi, r.end))
                    for lo, hi in ranges
                    for r in live.refs
                    if r.key in result.lost and r.end > lo and r.start < hi
                ]
            self.metrics.fetched(time.perf_counter() - started)
            self.engine.add_rows(seq, rows)
        except Exception as exc:
            log.exception("fetching media rows for sequence %d failed", seq.seq_id)
            live.failure = ErrorReply("media_unavailable", f"media rows could not be fetched: {exc}", 503)
            self.engine.fail(seq, str(exc))
        finally:
            self._wakeup.set()

    async def _repair(self, live: LiveRequest, lost: dict[ChunkKey, str]) -> bool:
        """Ask the processor to encode ``lost`` chunks again and wait for it; False if it ended."""
        causes = Counter(lost.values())
        if live.repairs >= self.cfg.max_repairs:
            message = f"{len(lost)} chunk(s) kept vanishing from their encoders ({dict(causes)})"
            live.failure = ErrorReply("encoder_churn", message + "; retry later", 503)
            self.engine.fail(live.seq, message)
            return False
        live.repairs += 1
        cause = "unreachable" if "unreachable" in causes else "missing"
        self.repairs[cause] += 1
        self.metrics.repairs.labels(cause).inc()
        log.info("sequence %d: re-encoding %d chunk(s) (%s)", live.seq.seq_id, len(lost), dict(causes))
        live.reencoded = asyncio.get_running_loop().create_future()
        try:
            await live.reply.send(NeedEncode(list(lost), cause), final=False)
            async with asyncio.timeout(self.cfg.repair_timeout):
                done = await live.reencoded
        except TimeoutError:
            message = f"the processor did not re-encode {len(lost)} chunk(s) in {self.cfg.repair_timeout:g} s"
            live.failure = ErrorReply("repair_timeout", message, 503)
            self.engine.fail(live.seq, message)
            return False
        finally:
            live.reencoded = None
        if len(done.sources) == len(live.refs):
            live.refs = [
                dataclasses.replace(r, source=s) for r, s in zip(live.refs, done.sources, strict=True)
            ]
        live.pinned.update(done.keys)
        return True
