"""KV block pool with a block-hash prefix cache.

Blocks are reference counted. A block nobody references sits in the free
queue, still holding its hash and contents, so a later request can revive it;
allocation takes the least recently freed block and only then forgets its hash.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from llm_stage.sequence import Sequence
from shared.block_hash import BlockHash


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # the block's tokens, to confirm a hash hit


@dataclass(slots=True)
class CacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    evictions: int = 0  # cached blocks whose hash was forgotten for reuse


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: insertion order is eviction order (front = least recently freed).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.stats = CacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix matching ----------------------------------------------------

    def match_prefix(self, hashes: list[BlockHash], token_ids: list[int]) -> list[int]:
        """Block ids of the longest cached prefix of ``hashes``, confirmed against stored tokens."""
        if not self.enable_caching:
            return []
        out: list[int] = []
        size = self.block_size
        for i, block_hash in enumerate(hashes):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                token_ids[i * size : (i + 1) * size]
            ):
                break
            out.append(block_id)
        return out

    def can_allocate(self, seq: Sequence, cached: list[int], num_new_tokens: int) -> bool:
        """Room for ``cached`` (revived) plus fresh blocks covering ``num_new_tokens`` more tokens?"""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        total = len(cached) * self.block_size + num_new_tokens
        fresh = self.blocks_needed(total) - len(cached)
        return revived + fresh <= len(self.free)

    def hold(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a probe's pin, or a request's prefix before admission)."""
        for block_id in blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1

    def release(self, blocks: list[int]) -> None:
        for block_id in reversed(blocks):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._to_free_queue(block)

    def allocate(self, seq: Sequence, cached: list[int]) -> None:
        """Admit ``seq`` with its cached prefix blocks (its new tokens get blocks via :meth:`grow`)."""
        assert not seq.block_table
        self.hold(cached)
        seq.block_table.extend(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        seq.num_cached_tokens = seq.num_computed_tokens

    # --- growth and release -----------------------------------------------------

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(seq.block_table) <= len(self.free)

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Give ``seq`` blocks for its first ``num_tokens`` tokens."""
        while len(seq.block_table) < self.blocks_needed(num_tokens):
            seq.block_table.append(self._take_free())

    def _to_free_queue(self, block: Block) -> None:
        self.free[block.block_id] = None
        if block.block_hash is None:
            # NOTE: blocks without a hash are the cheapest to reuse: first in line.
            self.free.move_to_end(block.block_id, last=False)

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            block.block_hash = None
            block.token_ids = ()
            self.stats.evictions += 1
        block.ref_count = 1
        return block_id

    def commit(self, seq: Sequence, hashes: list[BlockHash]) -> None:
        """Publish the hashes of ``seq``'s full, computed blocks so other requests can share them."""
        if not self.enable_caching:
            return
        full = min(seq.num_computed_tokens // self.block_size, len(hashes))
        for i in range(seq.num_committed_blocks, full):
            block = self.blocks[seq.block_table[i]]
            if block.block_hash is not None:
                continue
            block.block_hash = hashes[i]
            block.token_ids = tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])
            # NOTE: if an identical block was computed concurrently, the first stays canonical.
            self.cached.setdefault(hashes[i], block.block_id)
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks are freed first so they are evicted first."""
        self.release(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
