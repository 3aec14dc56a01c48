"""How a request that asks for prompt logprobs meets the prefix cache (the scheduler's side).

It matches only cached blocks that carry entries (:class:`llm_stage.prompt_logprobs.PromptLogprobStore`),
reads their entries at admission, computes the rest, writes the entries of its own full prompt
blocks before they are committed, and hands the whole list out once, with its first token.
"""

from __future__ import annotations

import torch

from mmcache.llm_stage.block_manager import BlockManager, PrefixMatch
from mmcache.llm_stage.prompt_logprobs import K_MAX, entries
from mmcache.llm_stage.sequence import Sequence
from mmcache.shared.block_hash import BlockHash
from mmcache.shared.messages import TokenLogprobs


def match_with_logprobs(bm: BlockManager, seq: Sequence, hashes: list[BlockHash]) -> PrefixMatch:
    """``seq``'s cached prefix over blocks that carry entries, less its last token (see
    :func:`back_off`); nothing without a store (every prompt token's logits are computed)."""
    if bm.logprobs is None:
        return PrefixMatch([])
    match = bm.match_prefix(hashes, seq.token_ids, seq.spans, seq.num_tokens - 1, with_logprobs=True)
    return back_off(match, bm.block_size)


def back_off(match: PrefixMatch, block_size: int) -> PrefixMatch:
    """``match`` less its last token, which is computed again: the first prompt logprob computed
    comes from its logits. The last cached block becomes a shared start (its KV copied but one
    slot); the blocks read for the cached entries are still ``match.held()``, in order."""
    if match.partial is not None and match.partial[1] >= 2:
        return PrefixMatch(match.blocks, (match.partial[0], match.partial[1] - 1))
    if not match.blocks:
        return PrefixMatch([])
    return PrefixMatch(match.blocks[:-1], (match.blocks[-1], block_size - 1))


def start(seq: Sequence, bm: BlockManager, match: PrefixMatch) -> None:
    """At admission: entries of the cached tokens, up to and with the first one computed (its
    entry comes from the cached token before it), read from the blocks that carry them."""
    if seq.plp_ids is None or seq.plp_values is None:
        shape = (seq.num_prompt_tokens, 1 + K_MAX)
        seq.plp_ids = torch.zeros(shape, dtype=torch.int32)
        seq.plp_values = torch.zeros(shape, dtype=torch.float32)
    first = seq.num_computed_tokens
    if first and bm.logprobs is not None:
        # NOTE: read at once: a source dropped by allocate() keeps its contents until reused.
        ids, values = bm.logprobs.read(match.held(), first + 1)
        seq.plp_ids[: first + 1] = ids
        seq.plp_values[: first + 1] = values


def store(seq: Sequence, bm: BlockManager) -> None:
    """Write the entries of ``seq``'s full prompt blocks that are about to be committed."""
    if bm.logprobs is None or seq.plp_ids is None or seq.plp_values is None:
        return
    size = bm.block_size
    full = min(seq.num_computed_tokens, seq.num_prompt_tokens) // size
    for i in range(seq.num_committed_blocks, full):
        block_id = seq.block_table[i]
        if bm.blocks[block_id].block_hash is None:  # not a shared, cached block
            rows = slice(i * size, (i + 1) * size)
            bm.logprobs.write(block_id, seq.plp_ids[rows], seq.plp_values[rows])


def take(seq: Sequence) -> list[TokenLogprobs | None]:
    """The prompt's entries, once (they go out with the first token; the rows are let go)."""
    assert seq.plp_ids is not None and seq.plp_values is not None  # made at admission
    out = entries(seq.plp_ids, seq.plp_values, seq.sampling.prompt_logprobs or 0)
    seq.plp_ids = seq.plp_values = None
    seq.plp_sent = True
    return out
