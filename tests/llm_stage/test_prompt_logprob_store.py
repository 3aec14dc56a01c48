"""The prompt logprob store beside the KV blocks: which blocks count as carrying entries, how a
request that asks matches only those, and that reuse of a block forgets them."""

from __future__ import annotations

import dataclasses

import torch

from mmcache.llm_stage.block_manager import BlockManager, PrefixMatch
from mmcache.llm_stage.prompt_logprob_blocks import back_off
from mmcache.llm_stage.prompt_logprobs import K_MAX, PromptLogprobStore, entries
from mmcache.llm_stage.scheduler import Scheduler
from tests.llm_stage.test_block_manager import B, make_seq

PROMPT = list(range(1, 11))  # 2 full blocks + 2 tokens


def pool(num_blocks: int = 8) -> tuple[BlockManager, PromptLogprobStore]:
    store = PromptLogprobStore(num_blocks, B, torch.device("cpu"))
    return BlockManager(num_blocks, B, enable_caching=True, logprobs=store), store


def asking(seq_id: int, ids: list[int]):
    seq = make_seq(seq_id, ids)
    seq.sampling = dataclasses.replace(seq.sampling, prompt_logprobs=2)
    return seq


def fill(bm: BlockManager, seq, store: PromptLogprobStore | None = None) -> None:
    """Allocate ``seq``'s whole prompt, mark every token's entry with its index, commit."""
    bm.allocate(seq, PrefixMatch([]))
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    if store is not None:
        for i in range(seq.num_tokens // B):
            rows = torch.arange(i * B, (i + 1) * B, dtype=torch.float32)[:, None].expand(B, 1 + K_MAX)
            store.write(seq.block_table[i], rows.to(torch.int32), rows)
    bm.commit(seq, seq.update_block_hashes(B))


def test_a_request_that_asks_matches_only_blocks_that_carry_entries() -> None:
    bm, store = pool()
    plain = make_seq(1, PROMPT)
    fill(bm, plain)  # cached KV, no entries
    assert store.num_carrying == 0
    seq = asking(2, PROMPT)
    hashes = seq.update_block_hashes(B)
    assert bm.match_prefix(hashes, seq.token_ids, limit=9).num_tokens(B) == 8
    assert bm.match_prefix(hashes, seq.token_ids, limit=9, with_logprobs=True).blocks == []
    assert Scheduler(bm, 4, 64).match(seq) == PrefixMatch([])


def test_a_block_with_entries_becomes_canonical_and_reuse_forgets_them() -> None:
    bm, store = pool(6)
    plain, scored = make_seq(1, PROMPT), asking(2, PROMPT)
    fill(bm, plain)
    fill(bm, scored, store)  # the same blocks computed again (fresh ones), now with entries
    seq = asking(3, PROMPT)
    found = bm.match_prefix(seq.update_block_hashes(B), seq.token_ids, limit=9, with_logprobs=True)
    assert found.blocks == scored.block_table[:2] != plain.block_table[:2]
    assert store.num_carrying == 2
    bm.free_seq(plain)
    bm.free_seq(scored)
    for _ in range(6):
        bm._take_free()  # every block reused: its entries go with its hash
    assert store.num_carrying == 0


def test_back_off_computes_the_last_cached_token_again() -> None:
    assert back_off(PrefixMatch([3, 4]), B) == PrefixMatch([3], (4, B - 1))
    assert back_off(PrefixMatch([3], (7, 3)), B) == PrefixMatch([3], (7, 2))
    assert back_off(PrefixMatch([3], (7, 1)), B) == PrefixMatch([], (3, B - 1))
    assert back_off(PrefixMatch([]), B) == PrefixMatch([])


def test_admission_reads_the_cached_entries_through_the_first_computed_token() -> None:
    bm, store = pool()
    fill(bm, asking(1, PROMPT), store)
    seq = asking(2, PROMPT)
    sched = Scheduler(bm, 4, 64)
    sched.add(seq)
    plan = sched.schedule()
    assert seq.num_cached_tokens == 7  # 8 cached, the 8th computed again for the 9th's entry
    assert plan.items[0].start == 7
    assert seq.plp_values[:8, 0].tolist() == list(range(8))
    out = entries(seq.plp_ids, seq.plp_values, 2)
    assert out[0] is None and out[5].logprob == 5.0 and len(out[5].top_ids) == 2
