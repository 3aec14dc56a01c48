"""KV block pool with a block-hash prefix cache.

Blocks are reference counted. A block nobody references sits in the free
queue, still holding its hash and contents, so a later request can revive it;
allocation takes the least recently freed block and only then forgets its hash.

Past the last full block that matches, a request can still share the *start* of
a cached block: the same image followed by a new question shares the image's
tail tokens, which sit in a block that also holds the old question. Every cached
block is indexed under its parent's hash, so the children of the last matched
block are compared token by token (and by media identity); the longest common
start is copied into a fresh block (copy on write) instead of being recomputed.
"""

from __future__ import annotations

import itertools
import sys
from collections import OrderedDict
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from mmcache.llm_stage.prompt_logprobs import PromptLogprobStore
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import BlockHash
from mmcache.shared.media_spans import chunk_places
from mmcache.shared.messages import MediaSpan

MAX_PARTIAL_CANDIDATES = 16  # children of one parent compared per match, most recent first

# (chunk key, chunk start - block start) of every media chunk overlapping a block, in order
BlockMedia = tuple[tuple[bytes, int], ...]


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()  # the block's tokens, to confirm a hash hit
    parent: BlockHash | None = None  # the previous block's hash (None for a first block)
    media: BlockMedia = ()


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """Cached full blocks, and optionally a block whose first ``tokens`` tokens come next."""

    blocks: list[int]
    partial: tuple[int, int] | None = None  # (block id, tokens)

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size + (self.partial[1] if self.partial else 0)

    def held(self) -> list[int]:
        return self.blocks + ([self.partial[0]] if self.partial else [])


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Copy the K/V of the first ``tokens`` slots of block ``source`` into block ``target``."""

    source: int
    target: int
    tokens: int


@dataclass(frozen=True, slots=True)
class Pin:
    """A probe's references on its matched prefix, until ``expiry`` (``time.monotonic()``) or until
    its request is admitted, ends or is refused, whichever comes first."""

    blocks: tuple[int, ...]
    expiry: float


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # prompt tokens served from the cache
    evictions: int = 0  # cached blocks whose hash was forgotten for reuse


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        logprobs: PromptLogprobStore | None = None,
    ):
        self.block_size = block_size
        self.logprobs = logprobs  # prompt logprobs kept per slot, freed and evicted with the block
        self.enable_caching = enable_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        # NOTE: insertion order is eviction order (front = least recently freed).
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.cached: dict[BlockHash, int] = {}
        self.children: dict[BlockHash, dict[int, None]] = {}  # parent hash → cached blocks, oldest first
        self.stats = PrefixCacheStats()
        self.pins: dict[int, Pin] = {}  # pin id → pin (probes' prefixes held for their requests)
        self._pin_ids = itertools.count(1)
        # KV tier hook: called (engine thread) with each block that becomes
        # the canonical copy of its hash, its KV and prompt logprob entries written.
        self.on_publish: Callable[[Block], None] | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix matching ----------------------------------------------------

    def match_prefix(
        self,
        hashes: list[BlockHash],
        token_ids: list[int],
        spans: Seq[MediaSpan] = (),
        limit: int | None = None,
        with_logprobs: bool = False,
    ) -> PrefixMatch:
        """The longest cached prefix of a prompt within its first ``limit`` tokens: full blocks by
        ``hashes`` (confirmed against stored tokens), then the longest start of a cached block that
        follows them (same tokens, same media chunks at the same places). ``with_logprobs``: only
        blocks that carry prompt logprobs."""
        if not self.enable_caching:
            return PrefixMatch([])
        size = self.block_size
        limit = len(token_ids) if limit is None else limit
        out: list[int] = []
        for i, block_hash in enumerate(hashes[: limit // size]):
            block_id = self.cached.get(block_hash)
            if block_id is None or self.blocks[block_id].token_ids != tuple(
                token_ids[i * size : (i + 1) * size]
            ):
                break
            if with_logprobs and not self._carries(block_id):
                break
            out.append(block_id)
        # NOTE: only a hit extends to a block's shared start. Without one the prefill would start at
        # token 0, with the cheaper causal attention; a few shared template tokens don't pay for
        # leaving it.
        if not out or hashes[len(out) - 1] not in self.children:
            return PrefixMatch(out)
        parent = hashes[len(out) - 1]
        start = len(out) * size
        want = token_ids[start : min(start + size, limit)]
        media = block_media(spans, start, size)
        return PrefixMatch(out, self._longest_start(parent, want, media, with_logprobs))

    def _carries(self, block_id: int) -> bool:
        return self.logprobs is not None and self.logprobs.has[block_id]

    def _longest_start(
        self, parent: BlockHash, want: list[int], media: BlockMedia, with_logprobs: bool = False
    ) -> tuple[int, int] | None:
        best = None
        for block_id in itertools.islice(reversed(self.children[parent]), MAX_PARTIAL_CANDIDATES):
            if with_logprobs and not self._carries(block_id):
                continue
            block = self.blocks[block_id]
            n = 0
            for a, b in zip(want, block.token_ids, strict=False):
                if a != b:
                    break
                n += 1
            n = min(n, _same_media_until(media, block.media))
            if n and (best is None or n > best[1]):
                best = (block_id, n)
        return best

    def can_allocate(self, match: PrefixMatch, num_new_tokens: int) -> bool:
        """Room to hold ``match`` (reviving its blocks; a shared start's source counts too, it is
        held until copied) plus blocks for ``num_new_tokens`` tokens after it?"""
        revived = sum(1 for b in match.held() if self.blocks[b].ref_count == 0)
        end = match.num_tokens(self.block_size) + num_new_tokens
        fresh = self.blocks_needed(end) - len(match.blocks)
        return revived + fresh <= len(self.free)

    # --- pins: a probe's prefix, held until its request is admitted -----------------------

    def pin(self, blocks: list[int], expiry: float) -> int:
        """Hold ``blocks`` until :meth:`unpin` or ``expiry`` (monotonic); returns the pin's id."""
        self._ref(blocks)
        pin_id = next(self._pin_ids)
        self.pins[pin_id] = Pin(tuple(blocks), expiry)
        return pin_id

    def unpin(self, pin_id: int) -> None:
        """Let a pin go (unknown or expired ids are ignored: a pin is let go once)."""
        pin = self.pins.pop(pin_id, None)
        if pin is not None:
            self.release(list(pin.blocks))

    def expire_pins(self, now: float) -> None:
        for pin_id in [p for p, pin in self.pins.items() if pin.expiry <= now]:
            self.unpin(pin_id)

    def next_pin_expiry(self) -> float | None:
        return min((pin.expiry for pin in self.pins.values()), default=None)

    def _ref(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (a pin's, an admitted prefix's, a shared start's source)."""
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

    def allocate(self, seq: Sequence, match: PrefixMatch) -> BlockCopy | None:
        """Admit ``seq`` with its cached prefix (its new tokens get blocks via :meth:`grow`).

        Returns:
            for a partial match, the copy of the shared start into ``seq``'s fresh block. Its
            source stays held until the caller has run the copy and released it.
        """
        assert not seq.block_table
        self._ref(match.held())
        seq.block_table.extend(match.blocks)
        seq.num_computed_tokens = len(match.blocks) * self.block_size
        copy = None
        if match.partial is not None:
            if self.free:
                source, tokens = match.partial
                seq.block_table.append(self._take_free())
                copy = BlockCopy(source, seq.block_table[-1], tokens)
                seq.num_computed_tokens += tokens
            else:
                self.release([match.partial[0]])
        seq.num_cached_tokens = seq.num_computed_tokens
        return copy

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
        if self.logprobs is not None:
            self.logprobs.forget(block_id)
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) == block_id:
                del self.cached[block.block_hash]
            parent = block.parent
            siblings = self.children.get(parent) if parent is not None else None
            if parent is not None and siblings is not None:
                siblings.pop(block_id, None)
                if not siblings:
                    del self.children[parent]
            block.block_hash = block.parent = None
            block.token_ids = block.media = ()
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
            # NOTE: if an identical block was computed concurrently, the first stays canonical,
            # unless only the new one carries prompt logprobs (then it serves every request).
            canonical = self.cached.setdefault(hashes[i], block.block_id)
            if canonical != block.block_id and self._carries(block.block_id) and not self._carries(canonical):
                self.cached[hashes[i]] = canonical = block.block_id
            if canonical == block.block_id and i:
                block.parent = hashes[i - 1]
                block.media = block_media(seq.spans, i * self.block_size, self.block_size)
                self.children.setdefault(block.parent, {})[block.block_id] = None
            if canonical == block.block_id and self.on_publish is not None:  # KV tier hook
                self.on_publish(block)
        seq.num_committed_blocks = max(seq.num_committed_blocks, full)

    def adopt(
        self, block_hash: BlockHash, parent: BlockHash | None, token_ids: tuple[int, ...], media: BlockMedia
    ) -> int | None:
        """KV tier hook: register a block whose KV comes from elsewhere as cached and free (the
        caller fills its slots at once, under the same lock). None if the hash is already cached
        or no block is free."""
        if not self.enable_caching or not self.free or block_hash in self.cached:
            return None
        block = self.blocks[self._take_free()]
        block.block_hash, block.token_ids = block_hash, token_ids
        self.cached[block_hash] = block.block_id
        if parent is not None:
            block.parent, block.media = parent, media
            self.children.setdefault(parent, {})[block.block_id] = None
        block.ref_count = 0
        self._to_free_queue(block)
        return block.block_id

    def free_seq(self, seq: Sequence) -> None:
        """Drop ``seq``'s references; tail blocks are freed first so they are evicted first."""
        self.release(seq.block_table)
        seq.block_table.clear()
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0


def _same_media_until(a: BlockMedia, b: BlockMedia) -> int:
    """Tokens from the block start over which ``a`` and ``b`` name the same chunks at the same
    places: up to the first chunk one of them has and the other has not (no limit if none)."""
    for x, y in itertools.zip_longest(a, b):
        if x != y:
            return max(min(c[1] for c in (x, y) if c is not None), 0)
    return sys.maxsize


def block_media(spans: Seq[MediaSpan], start: int, size: int) -> BlockMedia:
    """(chunk key, chunk start - ``start``) of the chunks overlapping tokens ``[start, start + size)``."""
    return tuple(
        (chunk.key, chunk.start - start)
        for chunk in chunk_places(spans)
        if chunk.end > start and chunk.start < start + size
    )
