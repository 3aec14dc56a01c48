"""The shared KV tier: full blocks' KV (and their prompt logprobs) kept in a store every replica
reads, so a prefix computed by one replica is a hit on another, or on itself after a restart.

Three sides, each off the step's compute:

- **write** (:meth:`KVTier.offer`, the engine thread, when the block manager publishes a block):
  the block's K/V and entries are copied to the host and queued; a writer thread encodes and
  stores them. The queue is bounded: when it is full (or the store is down) the block is dropped,
  counted, never waited for.
- **ask** (:meth:`KVTier.wanted`, the scheduler, before admitting a sequence): if the local pool
  lacks the next blocks of its chain, the sequence waits (``WAITING_FOR_KV``, skipped by the
  scheduler) while the service reads them (:meth:`KVTier.fetch`, bounded by the store timeout).
- **load** (:meth:`KVTier.adopt`, the engine thread, on an ``AddKV`` command): verified blocks
  are copied into free blocks and registered in the prefix cache; the sequence's admission then
  matches them like any cached block. Whatever did not come (absent, corrupt, timed out, no room)
  is computed.

Every value is verified before use (:func:`shared.kv_block_codec.decode`, then its tokens against
the sequence's); a fault changes nothing but speed, and is counted.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from mmcache.llm_stage.block_manager import Block, BlockManager, block_media
from mmcache.llm_stage.kv_cache import KVCache
from mmcache.llm_stage.kv_store import KVStore
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import BlockHash
from mmcache.shared.kv_block_codec import BadValue, KVLayout, StoredBlock, decode, encode

log = logging.getLogger(__name__)

WRITE_BATCH = 32  # blocks written in one round trip at most
# NOTE: how long the writer waits for more blocks before a round trip, so that the blocks one step
# publishes share one. A round trip of its own costs a 33 KiB block ~170 us of this process's CPU
# and ~45 us of the store's (redis-py, loopback, 2-core VM); four or more in one, ~60 and ~20 us.
WRITE_LINGER = 0.005
MAX_FETCH_BYTES = 64 << 20  # one request's read from the store at most (then it computes the rest)
# NOTE: a probe that found a prefix's next block absent spares the request's admission the read for
# this long. The request reaches the scheduler after its media is encoded: on a real-size tower with a
# queue of images that is seconds, and at 1 s most admissions on `mid` asked the store again.
ABSENT_SECONDS = 30.0
MAX_ABSENT = 4096  # block hashes remembered so
ERROR_REASONS = (
    "timeout",
    "connection",
    "full",
    "store",
    "truncated",
    "length",
    "checksum",
    "layout",
    "hash",
    "format",
    "tokens",
)


@dataclass(frozen=True, slots=True)
class KVWanted:
    """Blocks ``first, first + 1, ...`` of ``seq``'s chain (``hashes``) the local pool lacks."""

    seq: Sequence
    first: int
    hashes: list[BlockHash]


@dataclass(slots=True)
class KVTierStats:
    lookups: int = 0  # reads sent to the store
    skipped: int = 0  # reads not sent: the store was down, or lacked the next block, a moment ago
    hit_blocks: int = 0  # blocks read, verified and handed to the engine
    miss_blocks: int = 0  # reads that stopped at an absent block
    loaded_blocks: int = 0  # blocks copied into the pool (the engine's side of a hit)
    bytes_in: int = 0
    bytes_out: int = 0
    written_blocks: int = 0
    dropped_blocks: int = 0  # not written: queue full, store down or a write failed
    errors: Counter[str] = field(default_factory=Counter)


class KVTier:
    def __init__(self, store: KVStore, layout: KVLayout, queue_size: int):
        self.store = store
        self.layout = layout
        self.stats = KVTierStats()
        for reason in ERROR_REASONS:
            self.stats.errors[reason] += 0  # every reason is a series from the start
        self.on_latency: Callable[[float], None] = lambda seconds: None  # a metrics histogram
        self.max_fetch_blocks = max(1, MAX_FETCH_BYTES // (layout.kv_bytes + 4 * layout.block_size))
        self._queue: queue.Queue[tuple[str, StoredBlock] | None] = queue.Queue(maxsize=queue_size)
        # NOTE: the first block past a probed prefix that the store lacked, and when: the request
        # that follows the probe (once its media is encoded) is then computed without asking again.
        # A block written meanwhile is computed once more, which costs time and changes nothing.
        self._absent: OrderedDict[BlockHash, float] = OrderedDict()
        self._absent_lock = threading.Lock()
        self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
        self._writer.start()

    # --- write (engine thread, then the writer thread) -----------------------------------

    def offer(self, kv: KVCache, bm: BlockManager, block: Block) -> None:
        """Queue ``block`` (just published) for the store; dropped if the queue is full."""
        if block.block_hash is None:
            return
        if self._queue.full() or self.store.down():
            self.stats.dropped_blocks += 1
            return
        size, b = kv.block_size, block.block_id
        # NOTE: copied now: once the step moves on, the block may be taken for reuse.
        kv_copy = kv.kv[:, b * size : (b + 1) * size].to("cpu", copy=True)
        ids = values = None
        if bm.logprobs is not None and bm.logprobs.has[b]:
            ids, values = bm.logprobs.ids[b].to("cpu", copy=True), bm.logprobs.values[b].to("cpu", copy=True)
        item = StoredBlock(block.block_hash, block.token_ids, kv_copy, ids, values)
        try:
            self._queue.put_nowait((self.layout.key(block.block_hash), item))
        except queue.Full:
            self.stats.dropped_blocks += 1

    def _write_loop(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                self._queue.task_done()
                return
            batch = [first]
            linger = time.monotonic() + WRITE_LINGER
            while len(batch) < WRITE_BATCH:
                try:
                    more = self._queue.get(timeout=max(0.0, linger - time.monotonic()))
                except queue.Empty:
                    break
                if more is None:
                    self._queue.task_done()
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(more)
            try:
                self._write(batch)
            finally:
                for _ in batch:
                    self._queue.task_done()

    def _write(self, batch: list[tuple[str, StoredBlock]]) -> None:
        if self.store.down():
            self.stats.dropped_blocks += len(batch)
            return
        items = [(key, encode(self.layout, block)) for key, block in batch]
        try:
            self.store.set_many(items)
        except Exception as exc:
            self._failed(exc)
            self.stats.dropped_blocks += len(batch)
            return
        self.store.worked()
        self.stats.written_blocks += len(items)
        self.stats.bytes_out += sum(len(value) for _, value in items)

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued block is written or dropped (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1.0)
        self.store.close()

    # --- ask (scheduler) --------------------------------------------------------------

    def wanted(self, bm: BlockManager, seq: Sequence) -> KVWanted | None:
        """The next blocks of ``seq``'s chain past its local prefix, if worth asking the store for."""
        size = bm.block_size
        limit = (seq.num_tokens - 1) // size  # at least the last token is computed
        hashes = seq.update_block_hashes(size)
        local = bm.match_prefix(
            hashes, seq.token_ids, seq.spans, seq.num_tokens - 1, with_logprobs=seq.wants_prompt_logprobs
        )
        have = len(local.blocks)
        if have >= limit:
            return None
        if self.store.down() or self._recently_absent(hashes[have]):
            self.stats.skipped += 1
            return None
        return KVWanted(seq, have, list(hashes[have : min(limit, have + self.max_fetch_blocks)]))

    # --- read (event loop) ----------------------------------------------------------------

    async def fetch(self, hashes: list[BlockHash]) -> list[StoredBlock]:
        """The leading blocks of ``hashes`` the store holds, verified; [] on any store fault."""
        if not hashes:
            return []
        if self.store.down():
            self.stats.skipped += 1
            return []
        self.stats.lookups += 1
        started = time.perf_counter()
        try:
            async with asyncio.timeout(self.store.timeout):
                values = await self.store.get_many([self.layout.key(h) for h in hashes])
        except Exception as exc:
            self._failed(exc)
            return []
        finally:
            self.on_latency(time.perf_counter() - started)
        self.store.worked()
        out: list[StoredBlock] = []
        for block_hash, value in zip(hashes, values, strict=True):
            if value is None:
                self.stats.miss_blocks += 1
                break
            self.stats.bytes_in += len(value)
            try:
                out.append(decode(self.layout, block_hash, value))
            except BadValue as exc:
                self.stats.errors[exc.reason] += 1
                log.warning("kv store: refused block %s (%s)", block_hash.hex(), exc.reason)
                break
        self.stats.hit_blocks += len(out)
        return out

    async def stored(self, hashes: list[BlockHash]) -> int:
        """How many leading blocks of ``hashes`` the store holds (a probe's hint: not read, not
        checked); 0 on any store fault."""
        if not hashes or self.store.down():
            return 0
        key = self.layout.key
        try:
            async with asyncio.timeout(self.store.timeout):
                # NOTE: the first block alone, then the rest only if it is there: a prefix the store
                # lacks (every unseen prompt) costs one small command, not one per block.
                found = await self.store.exists_many([key(hashes[0])])
                if found[0] and len(hashes) > 1:
                    found += await self.store.exists_many([key(h) for h in hashes[1:]])
        except Exception as exc:
            self._failed(exc)
            return 0
        self.store.worked()
        n = 0
        while n < len(found) and found[n]:
            n += 1
        with self._absent_lock:
            if n:  # present now: an older probe's mark (its request went elsewhere) is stale
                self._absent.pop(hashes[0], None)
            else:
                self._absent[hashes[0]] = time.monotonic()
                self._absent.move_to_end(hashes[0])
                while len(self._absent) > MAX_ABSENT:
                    self._absent.popitem(last=False)
        return n

    def _recently_absent(self, block_hash: BlockHash) -> bool:
        with self._absent_lock:
            seen = self._absent.pop(block_hash, None)
        return seen is not None and time.monotonic() - seen < ABSENT_SECONDS

    def _failed(self, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError | redis.TimeoutError):
            reason = "timeout"
        elif isinstance(exc, redis.ConnectionError | OSError):
            reason = "connection"
        elif isinstance(exc, redis.exceptions.OutOfMemoryError) or "maxmemory" in str(exc):
            reason = "full"
        else:
            reason = "store"
        self.stats.errors[reason] += 1
        if self.store.up:
            log.warning("kv store %s: %s (%s); computing without it for a while", self.store.url, reason, exc)
        self.store.failed()

    # --- load (engine thread) --------------------------------------------------------------

    def adopt(
        self, kv: KVCache, bm: BlockManager, seq: Sequence, first: int, blocks: list[StoredBlock]
    ) -> int:
        """Copy ``blocks`` (``seq``'s chain from block ``first``) into the pool as cached, free
        blocks; stops at the first that does not fit the sequence or finds no room. Returns how
        many of the chain are now in the pool."""
        size = bm.block_size
        n = 0
        for i, stored in enumerate(blocks, start=first):
            if i >= len(seq.block_hashes) or seq.block_hashes[i] != stored.block_hash:
                break
            if stored.token_ids != tuple(seq.token_ids[i * size : (i + 1) * size]):
                self.stats.errors["tokens"] += 1
                break
            parent = seq.block_hashes[i - 1] if i else None
            block_id = bm.adopt(
                stored.block_hash, parent, stored.token_ids, block_media(seq.spans, i * size, size)
            )
            if block_id is None:
                local = bm.cached.get(stored.block_hash)
                if local is None:
                    break  # no free block
                block_id = local  # computed meanwhile; it may still lack the entries
            else:
                kv.kv[:, block_id * size : (block_id + 1) * size] = stored.kv.to(kv.kv.device)
                self.stats.loaded_blocks += 1
            store = bm.logprobs
            if store is not None and stored.logprob_ids is not None and not store.has[block_id]:
                assert stored.logprob_values is not None
                store.write(block_id, stored.logprob_ids, stored.logprob_values)
            n += 1
        return n
