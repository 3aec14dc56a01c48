"""The scheduler's side of the shared KV tier, without a model or a store: a sequence whose prefix
the store is read for waits in WAITING_FOR_KV, skipped while others are admitted and computed; it
is asked for once, goes back to the front of the queue when the read is done (found or not), and
can be cancelled while it waits."""

from __future__ import annotations

from mmcache.llm_stage.block_manager import BlockManager
from mmcache.llm_stage.kv_tier import KVWanted
from mmcache.llm_stage.scheduler import Scheduler, StepPlan
from mmcache.llm_stage.sequence import SeqStatus, Sequence
from mmcache.shared.block_hash import root_hash
from mmcache.shared.keys import Fingerprint
from mmcache.shared.messages import SamplingParams

B = 4
ROOT = root_hash(Fingerprint(b"\x09" * 16), None)
SAMPLING = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


def seq(seq_id: int, n: int) -> Sequence:
    return Sequence.new(
        seq_id, list(range(100 * seq_id, 100 * seq_id + n)), [], ROOT, SAMPLING, 1024, [], 1.0
    )


def step(sched: Scheduler) -> StepPlan:
    plan = sched.schedule()
    sched.postprocess(plan, [7] * len(plan.sampled))
    return plan


def scheduler(asks: dict[int, int]) -> Scheduler:
    """A scheduler whose KV tier hook asks for ``asks[seq_id]`` blocks of those sequences."""
    sched = Scheduler(BlockManager(64, B, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=64)

    def wanted(s: Sequence) -> KVWanted | None:
        n = asks.get(s.seq_id, 0)
        return KVWanted(s, 0, s.update_block_hashes(B)[:n]) if n else None

    sched.kv_wanted = wanted
    return sched


def test_a_sequence_waits_for_the_store_while_others_run():
    sched = scheduler({1: 3})
    a, b = seq(1, 14), seq(2, 10)
    sched.add(a)
    sched.add(b)
    plan = step(sched)
    assert [w.seq for w in plan.kv_fetches] == [a] and len(plan.kv_fetches[0].hashes) == 3
    assert a.status is SeqStatus.WAITING_FOR_KV and a in sched.kv_waiting
    assert [item.seq for item in plan.items] == [b]  # admitted behind it, computed meanwhile
    plan = step(sched)
    assert plan.kv_fetches == [] and all(item.seq is b for item in plan.items)  # asked once
    sched.kv_arrived(a)  # the read is done (nothing found): computed from the start
    assert a.status is SeqStatus.WAITING and sched.waiting[0] is a
    plan = step(sched)
    assert plan.kv_fetches == [] and any(item.seq is a and item.start == 0 for item in plan.items)
    while sched.has_work():
        step(sched)
    assert a.finish_reason == b.finish_reason == "length"


def test_a_sequence_cancelled_while_it_waits_for_the_store():
    sched = scheduler({1: 2})
    a = seq(1, 12)
    sched.add(a)
    step(sched)
    # NOTE: a parked sequence is unfinished work, but none a step could advance
    assert a.status is SeqStatus.WAITING_FOR_KV and sched.num_unfinished == 1 and not sched.has_work()
    assert sched.abort(a)
    assert a.status is SeqStatus.FINISHED and not sched.kv_waiting and sched.num_unfinished == 0
    sched.kv_arrived(a)  # the read ends later: nothing happens
    assert a.status is SeqStatus.FINISHED and not sched.waiting


def test_no_hook_no_wait():
    sched = Scheduler(BlockManager(64, B, enable_caching=True), max_num_seqs=4, max_num_batched_tokens=64)
    a = seq(1, 14)
    sched.add(a)
    plan = step(sched)
    assert plan.kv_fetches == [] and a.status is SeqStatus.RUNNING
