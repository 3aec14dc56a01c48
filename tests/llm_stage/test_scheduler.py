"""Media rows as a resource the scheduler owns: a step covers only tokens whose rows are present,
missing rows are asked for once in the step plan, and the fetch after a prefix hit and the fetch
after a preemption that lost part of the prefix are one path (exact token ranges asserted)."""

from __future__ import annotations

import torch

from mmcache.llm_stage.block_manager import BlockManager
from mmcache.llm_stage.scheduler import RowsWanted, Scheduler, StepPlan
from mmcache.llm_stage.sequence import MediaRows, SeqStatus, Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import MediaSpan, SamplingParams

B = 4
ROOT = root_hash(Fingerprint(b"\x07" * 16), None)
IMG = 50


def image_seq(seq_id: int, question: list[int], max_tokens: int = 4) -> Sequence:
    """6 text tokens, an 8-token image at [6, 14), then the question."""
    span = MediaSpan(6, "image", (1, 4, 8), [b"K" * 16])  # 4 * 8 / 4 = 8 tokens
    ids = [1, 2, 3, 4, 5, 6, *[IMG] * 8, *question]
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return Sequence.new(seq_id, ids, [span], ROOT, sampling, 1024, [], 1.0)


def rows(start: int, end: int) -> MediaRows:
    return MediaRows(start, torch.zeros(end - start, 2))


def step(sched: Scheduler) -> StepPlan:
    plan = sched.schedule()
    sched.postprocess(plan, [7] * len(plan.sampled))
    return plan


def spans_of(plan: StepPlan) -> list[tuple[int, int, int]]:
    return [(item.seq.seq_id, item.start, item.end) for item in plan.items]


def test_a_step_stops_before_media_whose_rows_are_missing_and_asks_for_them_once():
    sched = Scheduler(BlockManager(32, B, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=64)
    seq = image_seq(1, [60, 61, 62])
    sched.add(seq)
    plan = step(sched)
    assert spans_of(plan) == [(1, 0, 6)]  # the text before the image, computed while rows come
    assert plan.fetches == [RowsWanted(seq, [(6, 14)])]
    assert plan.admitted == [seq]
    plan = step(sched)
    assert plan.items == [] and plan.fetches == []  # waits; the fetch is not asked for again
    assert seq.status is SeqStatus.WAITING_FOR_MEDIA and seq in sched.running
    seq.media.append(rows(6, 14))
    sched.rows_arrived(seq)
    assert spans_of(step(sched)) == [(1, 6, 17)]  # the image and the question, then decodes
    while sched.has_work():
        assert step(sched).fetches == []
    assert seq.finish_reason == "length" and seq.num_output_tokens == 4


def test_a_waiting_sequence_does_not_hold_back_the_others():
    sched = Scheduler(BlockManager(32, B, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=64)
    blocked, text = (
        image_seq(1, [60]),
        Sequence.new(2, [9, 8, 7], [], ROOT, SamplingParams(max_tokens=3, temperature=0.0), 1024, [], 1.0),
    )
    sched.add(blocked)
    sched.add(text)
    step(sched)
    for _ in range(3):
        step(sched)
    assert text.finish_reason == "length" and blocked.status is SeqStatus.WAITING_FOR_MEDIA


def test_a_prefix_hit_asks_only_for_rows_after_it():
    bm = BlockManager(32, B, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = image_seq(1, [60, 61, 62, 63, 64, 65])
    first.media.append(rows(6, 14))
    sched.add(first)
    while sched.has_work():
        step(sched)
    # same text and image, another question: blocks 0-2 (tokens 0-11) hit; the image's last two
    # tokens sit in block 3 with the old question's first tokens: shared by copy (tokens 12, 13)
    second = image_seq(2, [70, 71])
    sched.add(second)
    plan = step(sched)
    assert second.num_cached_tokens == 14 and plan.fetches == []  # the whole image was cached
    third = image_seq(3, [80])  # a different image after the same text: only the text hits
    third.spans[0] = MediaSpan(6, "image", (1, 4, 8), [b"Q" * 16])
    third.block_hashes = []
    sched.add(third)
    plan = step(sched)
    assert third.num_cached_tokens == 6
    assert plan.fetches == [RowsWanted(third, [(6, 14)])]


def test_preemption_that_loses_the_prefix_refetches_through_the_same_path():
    """A request whose image the cached prefix covered never fetched its rows. Preempted, its
    prefix evicted, it is admitted again: the rows it now needs are asked for in the plan, and
    it resumes from what is still cached."""
    bm = BlockManager(8, B, enable_caching=True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    first = image_seq(1, [60, 61, 62, 63])
    first.media.append(rows(6, 14))
    sched.add(first)
    while sched.has_work():
        step(sched)
    seq = image_seq(2, [60, 61, 62, 63, 64], max_tokens=2)
    sched.add(seq)
    plan = step(sched)
    assert seq.num_cached_tokens == 18 and plan.fetches == [] and seq.media == []  # 16 + 2 shared
    sched._preempt(seq)  # as a growing neighbour would
    assert seq.status is SeqStatus.WAITING and seq.block_table == []
    hog = Sequence.new(3, list(range(100, 128)), [], ROOT, SamplingParams(1, 0.0), 1024, [], 1.0)
    sched.waiting.append(hog)  # 28 tokens: takes 7 of 8 blocks, evicting the cached image blocks
    sched.waiting.rotate(1)
    step(sched)
    while hog.status is not SeqStatus.FINISHED:
        step(sched)
    plan = sched.schedule()
    assert seq in sched.running and plan.admitted == []  # admitted again, not for the first time
    assert seq.num_computed_tokens == 0  # the hog evicted the whole prefix ...
    assert plan.fetches == [RowsWanted(seq, [(6, 14)])]  # ... so the image's rows are wanted now
    assert spans_of(plan) == [(2, 0, 6)]
    sched.postprocess(plan, [7] * len(plan.sampled))
    seq.media.append(rows(*plan.fetches[0].ranges[0]))
    sched.rows_arrived(seq)
    while sched.has_work():
        step(sched)
    assert seq.finish_reason == "length" and seq.num_output_tokens == 2
