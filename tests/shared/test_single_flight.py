"""Single flight: one computation per key at a time, shared by every caller."""

from __future__ import annotations

import asyncio

from mmcache.shared.single_flight import SingleFlight


async def test_concurrent_callers_share_one_computation_and_only_the_first_owns_it():
    flight: SingleFlight[str, int] = SingleFlight()
    calls = 0

    async def make() -> int:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.01)
        return 42

    results = await asyncio.gather(*(flight.run("k", make) for _ in range(5)))
    assert calls == 1
    assert sorted(results) == [(42, False)] * 4 + [(42, True)]
    assert "k" not in flight


async def test_a_cancelled_caller_does_not_cancel_the_others():
    flight: SingleFlight[str, int] = SingleFlight()
    started = asyncio.Event()

    async def make() -> int:
        started.set()
        await asyncio.sleep(0.05)
        return 7

    first = asyncio.create_task(flight.run("k", make))
    await started.wait()
    second = asyncio.create_task(flight.run("k", make))
    await asyncio.sleep(0)
    first.cancel()
    assert await second == (7, False)


async def test_a_failure_reaches_every_waiter_and_is_not_kept():
    flight: SingleFlight[str, int] = SingleFlight()

    async def boom() -> int:
        await asyncio.sleep(0.01)
        raise ValueError("bad bytes")

    outcomes = await asyncio.gather(flight.run("k", boom), flight.run("k", boom), return_exceptions=True)
    assert all(isinstance(o, ValueError) for o in outcomes)

    async def fine() -> int:
        return 1

    assert await flight.run("k", fine) == (1, True)  # computed again
