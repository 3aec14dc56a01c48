"""Prefix caching in the block pool, in the style of vLLM's CPU prefix-caching tests:
exact block ids, hit lengths and eviction order."""

from __future__ import annotations

import torch

from mmcache.llm_stage.block_manager import BlockCopy, BlockManager
from mmcache.llm_stage.scheduler import Scheduler
from mmcache.llm_stage.sequence import MediaRows, Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import MediaSpan, SamplingParams

B = 4
ROOT = root_hash(Fingerprint(b"\x07" * 16), None)
IMG = 50


def make_seq(seq_id: int, ids: list[int], spans: list[MediaSpan] | None = None, root=ROOT) -> Sequence:
    return Sequence.new(
        seq_id, ids, spans or [], root, SamplingParams(max_tokens=8, temperature=0.0), 1024, [], 1.0
    )


def match(bm: BlockManager, seq: Sequence):
    """What the scheduler matches: at most all tokens but the last."""
    return bm.match_prefix(seq.update_block_hashes(B), seq.token_ids, seq.spans, seq.num_tokens - 1)


def admit(bm: BlockManager, seq: Sequence) -> int:
    """Match, allocate and fill ``seq``'s prompt as the scheduler would; returns the hit in tokens."""
    found = match(bm, seq)
    assert bm.can_allocate(found, seq.num_tokens - found.num_tokens(B))
    copy = bm.allocate(seq, found)
    hit = seq.num_computed_tokens
    if copy is not None:  # (the runner's copy of a shared block start, then its source goes)
        bm.release([copy.source])
    bm.grow(seq, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.commit(seq, seq.update_block_hashes(B))
    return hit


def test_allocation_takes_blocks_in_order_and_hashes_full_blocks():
    bm = BlockManager(10, B, enable_caching=True)
    seq = make_seq(1, list(range(10)))  # 2 full blocks + 2 tokens
    assert admit(bm, seq) == 0
    assert seq.block_table == [0, 1, 2]
    assert [bm.blocks[i].block_hash is not None for i in (0, 1, 2)] == [True, True, False]
    assert bm.num_free_blocks == 7


def test_second_request_hits_the_shared_prefix_with_exact_ids():
    bm = BlockManager(10, B, enable_caching=True)
    a = make_seq(1, list(range(10)))
    admit(bm, a)
    b = make_seq(2, [*list(range(8)), 90, 91, 92])  # shares tokens 0..7 = blocks 0, 1
    assert admit(bm, b) == 8
    assert b.block_table[:2] == [0, 1]
    assert b.block_table[2:] == [3]  # its own tail
    assert bm.blocks[0].ref_count == 2 and bm.blocks[1].ref_count == 2


def test_full_prompt_hit_still_computes_the_last_token():
    bm = BlockManager(10, B, enable_caching=True)
    ids = list(range(8))  # exactly two blocks
    admit(bm, make_seq(1, ids))
    again = make_seq(2, ids)
    assert admit(bm, again) == 7  # block 0, then 3 of block 1's tokens copied: the last is recomputed
    assert again.block_table[0] == 0 and again.block_table[1] != 1  # its own copy of block 1


def test_freed_blocks_stay_cached_and_are_revived():
    bm = BlockManager(6, B, enable_caching=True)
    a = make_seq(1, list(range(9)))
    admit(bm, a)
    bm.free_seq(a)
    assert bm.num_free_blocks == 6
    b = make_seq(2, list(range(9)))
    assert admit(bm, b) == 8
    assert b.block_table[:2] == [0, 1]


def test_eviction_order_is_lru_and_tail_first():
    bm = BlockManager(6, B, enable_caching=True)
    a = make_seq(1, list(range(12)))  # blocks 0,1,2 hashed (12 tokens = 3 full blocks)
    admit(bm, a)
    bm.free_seq(a)
    # NOTE: freed in reverse, so the free queue now ends ... 2, 1, 0: the chain's tail goes first.
    assert list(bm.free)[-3:] == [2, 1, 0]
    c = make_seq(2, list(range(100, 120)))  # needs 5 blocks: 3 never-hashed, then 2, 1
    admit(bm, c)
    assert c.block_table == [3, 4, 5, 2, 1]
    assert bm.stats.evictions == 2
    bm.free_seq(c)
    d = make_seq(3, [*list(range(4)), 77, 78])
    assert admit(bm, d) == 4  # block 0 (the chain's head) survived


def test_disabled_cache_never_hits():
    bm = BlockManager(10, B, enable_caching=False)
    admit(bm, make_seq(1, list(range(9))))
    assert admit(bm, make_seq(2, list(range(9)))) == 0


def test_same_placeholders_of_two_images_do_not_share_blocks():
    bm = BlockManager(20, B, enable_caching=True)
    ids = [1, 2, 3, 4] + [IMG] * 8 + [5, 6, 7, 8, 9]
    span_a = MediaSpan(4, "image", (1, 4, 8), [b"a" * 16])  # 8 tokens
    span_b = MediaSpan(4, "image", (1, 4, 8), [b"b" * 16])
    admit(bm, make_seq(1, ids, [span_a]))
    assert admit(bm, make_seq(2, ids, [span_b])) == 4  # only the text block before the image
    assert admit(bm, make_seq(3, ids, [span_a])) == 16


def test_salt_separates_blocks():
    bm = BlockManager(20, B, enable_caching=True)
    ids = list(range(12))
    admit(bm, make_seq(1, ids))
    salted = make_seq(2, ids, root=root_hash(Fingerprint(b"\x07" * 16), "tenant"))
    assert admit(bm, salted) == 0


def test_hash_hit_is_confirmed_against_stored_tokens():
    bm = BlockManager(10, B, enable_caching=True)
    a = make_seq(1, list(range(9)))
    admit(bm, a)
    forged = make_seq(2, [*list(range(4)), 40, 41, 42, 43, 44])
    hashes = forged.update_block_hashes(B)
    hashes[1] = a.block_hashes[1]  # pretend a collision on block 1
    assert bm.match_prefix(hashes[:2], forged.token_ids).blocks == [0]


def test_a_pin_keeps_blocks_out_of_the_free_queue_until_unpinned():
    bm = BlockManager(4, B, enable_caching=True)
    a = make_seq(1, list(range(9)))
    admit(bm, a)
    bm.free_seq(a)
    pin = bm.pin([0, 1], expiry=float("inf"))  # a probe's pin
    assert 0 not in bm.free and 1 not in bm.free
    big = make_seq(2, list(range(100, 108)))
    admit(bm, big)
    assert set(big.block_table).isdisjoint({0, 1})
    bm.unpin(pin)
    bm.unpin(pin)  # a second let-go changes nothing
    assert 0 in bm.free and 1 in bm.free and not bm.pins


def test_pins_expire_at_their_deadline():
    bm = BlockManager(4, B, enable_caching=True)
    early, late = bm.pin([0], expiry=10.0), bm.pin([1], expiry=20.0)
    assert bm.next_pin_expiry() == 10.0
    bm.expire_pins(now=15.0)
    assert list(bm.pins) == [late] and early not in bm.pins
    assert 0 in bm.free and 1 not in bm.free
    assert bm.next_pin_expiry() == 20.0
    bm.expire_pins(now=20.0)
    assert not bm.pins and bm.next_pin_expiry() is None and bm.num_free_blocks == 4


def test_scheduler_preempts_newest_and_resumes_from_cache():
    """A pool too small for two growing sequences: the newer one is preempted, later resumed
    with its computed blocks revived from the cache, and nothing deadlocks."""
    bm = BlockManager(6, B, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a, b = make_seq(1, list(range(9))), make_seq(2, list(range(200, 209)))
    for s in (a, b):
        s.sampling = SamplingParams(max_tokens=12, temperature=0.0)
        sched.add(s)
    steps = 0
    while sched.has_work() and steps < 100:
        plan = sched.schedule()
        sched.postprocess(plan, [7] * len(plan.sampled))
        steps += 1
    assert not sched.has_work()
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == b.num_output_tokens == 12
    assert sched.num_preemptions >= 1
    assert bm.num_free_blocks == 6


# --- sharing the start of a block ---------------------------------------------------------


def image_prompt(question: list[int], key: bytes = b"K" * 16) -> tuple[list[int], list[MediaSpan]]:
    """5 text tokens, a 6-token image at [5, 11), then the question (B = 4: the image ends inside
    block 2, which it shares with the question's first token)."""
    span = MediaSpan(5, "image", (1, 2, 12), [key])  # 1 * 2 * 12 / 4 = 6 tokens
    return [1, 2, 3, 4, 5, *[IMG] * 6, *question], [span]


def test_new_question_about_the_same_image_shares_the_image_tail():
    bm = BlockManager(20, B, enable_caching=True)
    a = make_seq(1, *image_prompt([60, 61, 62, 63, 64]))
    admit(bm, a)
    b = make_seq(2, *image_prompt([70, 71, 72]))
    found = match(bm, b)
    assert found.blocks == a.block_table[:2]  # tokens 0..7
    assert found.partial == (a.block_table[2], 3)  # tokens 8, 9, 10: the image's tail
    copy = bm.allocate(b, found)
    assert b.num_computed_tokens == b.num_cached_tokens == 11
    own = b.block_table[2]
    assert own not in a.block_table and copy == BlockCopy(a.block_table[2], own, 3)
    assert bm.blocks[a.block_table[2]].ref_count == 2  # the source is held until copied ...
    bm.release([copy.source])
    assert bm.blocks[a.block_table[2]].ref_count == 1  # ... then let go


def test_a_different_image_with_the_same_placeholders_shares_only_the_text_before_it():
    bm = BlockManager(20, B, enable_caching=True)
    admit(bm, make_seq(1, *image_prompt([60, 61])))
    other = make_seq(2, *image_prompt([60, 61], key=b"Q" * 16))
    found = match(bm, other)
    assert len(found.blocks) == 1  # block 1 holds the image's start: its hash differs
    assert found.partial is not None and found.partial[1] == 1  # token 4, not the image at 5
    assert found.num_tokens(B) == 5


def test_the_same_image_one_token_later_shares_nothing_of_it():
    bm = BlockManager(20, B, enable_caching=True)
    admit(bm, make_seq(1, *image_prompt([60, 61])))
    ids, _ = image_prompt([60, 61])
    shifted = make_seq(2, [1, 2, 3, 4, 5, 9, *ids[5:]], [MediaSpan(6, "image", (1, 2, 12), [b"K" * 16])])
    assert match(bm, shifted).num_tokens(B) == 5


def test_a_shared_start_never_covers_the_last_token():
    bm = BlockManager(20, B, enable_caching=True)
    admit(bm, make_seq(1, list(range(10))))
    found = match(bm, make_seq(2, list(range(7))))
    assert found.num_tokens(B) == 6  # block 0 and 2 tokens of block 1; token 6 is computed


def test_no_shared_start_without_a_full_block_hit():
    """Sharing a few first tokens (a chat template's) would trade a from-scratch prefill for an
    offset one, which costs more than those tokens: a shared start only extends a real hit."""
    bm = BlockManager(20, B, enable_caching=True)
    admit(bm, make_seq(1, list(range(10))))
    assert match(bm, make_seq(2, [0, 1, 2, 99, 98, 97, 96])).num_tokens(B) == 0
    assert match(bm, make_seq(3, [0, 1, 2, 3, 4, 5, 99, 98])).num_tokens(B) == 6


def test_an_evicted_block_is_no_longer_shared():
    bm = BlockManager(4, B, enable_caching=True)
    a = make_seq(1, list(range(10)))  # blocks 0, 1, 2 (block 2 is partial: never cached)
    admit(bm, a)
    bm.free_seq(a)
    admit(bm, b := make_seq(2, list(range(100, 116))))  # needs all 4 blocks: evicts a's
    assert match(bm, make_seq(3, list(range(7)))).num_tokens(B) == 0
    # no index entry outlives its block: only b's cached blocks are indexed, under their parents
    indexed = {(parent, block_id) for parent, ids in bm.children.items() for block_id in ids}
    assert indexed == {(bm.blocks[i].parent, i) for i in b.block_table[1:] if bm.blocks[i].block_hash}


def test_admission_plans_the_shared_start_copy_and_holds_its_source_until_then():
    bm = BlockManager(20, B, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    a = make_seq(1, *image_prompt([60, 61, 62]))
    a.media = [MediaRows(5, torch.zeros(6, 1))]
    admit(bm, a)
    table = list(a.block_table)
    bm.free_seq(a)
    b = make_seq(2, *image_prompt([70, 71]))
    sched.add(b)
    plan = sched.schedule()
    (copy,) = plan.copies
    assert copy == BlockCopy(table[2], b.block_table[2], 3)
    assert bm.blocks[copy.source].ref_count == 1  # held for the copy alone (a is gone)
    assert plan.admitted == [b] and b.num_cached_tokens == 11
    assert [(i.start, i.end, i.samples) for i in plan.items] == [(11, 13, True)]
    assert plan.fetches == []  # the image lies inside the cached prefix: no rows wanted


def test_a_shared_start_source_counts_against_room():
    """The source of a shared start is held until the copy: admission must count it, or the
    blocks it takes out of the free queue could be missing when the prompt grows."""
    bm = BlockManager(4, B, enable_caching=True)
    a = make_seq(1, list(range(12)))  # 3 blocks, all cached
    admit(bm, a)
    table = list(a.block_table)
    bm.free_seq(a)
    b = make_seq(2, [*range(6), 90, 91, 92, 93, 94, 95, 96, 97, 98])  # block 0, then 2 shared tokens
    found = match(bm, b)
    assert found.blocks == [table[0]] and found.partial == (table[1], 2)
    # the 7 tokens after the shared start end at token 13: 3 fresh blocks after block 0; with both
    # held blocks revived that is 5 > 4
    assert not bm.can_allocate(found, b.num_tokens - 6)
    assert bm.can_allocate(found, 4)  # a first chunk that fits (ends at token 10: 2 fresh + 2)


def test_admission_counts_the_shared_start_and_drops_it_when_room_is_short():
    """Block 0 and a 2-token shared start cached in a 4-block pool; a 7-token first chunk after
    the shared start ends at token 13 (4 blocks), and the source held for the copy would make 5:
    the scheduler admits without the shared start rather than overrun the pool or wait forever."""
    bm = BlockManager(4, B, enable_caching=True)
    admit(bm, a := make_seq(1, list(range(12))))
    bm.free_seq(a)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=7)
    ids = [*range(6), 90, 91, 92, 93, 94, 95, 96, 97, 98]
    b = Sequence.new(2, ids, [], ROOT, SamplingParams(max_tokens=1, temperature=0.0), 1024, [], 1.0)
    sched.add(b)
    plan = sched.schedule()
    assert plan.copies == [] and b.num_cached_tokens == 4
    assert [(i.start, i.end) for i in plan.items] == [(4, 11)]
    for _ in range(3):
        plan = sched.schedule()
        sched.postprocess(plan, [7] * len(plan.sampled))
    assert b.finish_reason == "length" and not sched.has_work()
