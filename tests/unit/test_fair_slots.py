"""api/fair_slots.py: database slots shared out round robin across keys."""
from __future__ import annotations

import asyncio

import pytest

from nightshift.api.fair_slots import FairSlots


def test_a_lone_request_of_another_key_is_served_next_not_behind_a_pile():
    async def scenario() -> list[str]:
        slots = FairSlots(1)
        served: list[str] = []
        await slots.acquire("A")                          # A holds the one slot

        async def work(key: str, name: str) -> None:
            await slots.acquire(key)
            served.append(name)
            await asyncio.sleep(0)
            slots.release()

        pile = [asyncio.create_task(work("A", f"A{i}")) for i in range(5)]
        await asyncio.sleep(0)                            # A's five queue first
        polite = asyncio.create_task(work("B", "B0"))
        await asyncio.sleep(0)
        assert slots.waiting == 6 and slots.value == 0
        slots.release()
        await asyncio.gather(*pile, polite)
        assert slots.value == 1 and slots.waiting == 0
        return served

    served = asyncio.run(scenario())
    assert served[:2] == ["A0", "B0"]                     # B's request after one of A's, not after five
    assert served[2:] == ["A1", "A2", "A3", "A4"]         # each key in its own order


def test_free_slots_are_taken_at_once_and_given_back():
    async def scenario() -> None:
        slots = FairSlots(2)
        await slots.acquire("A")
        await slots.acquire("B")
        assert slots.value == 0
        slots.release()
        slots.release()
        assert slots.value == 2

    asyncio.run(scenario())


def test_a_waiter_that_gives_up_takes_no_slot_and_leaves_no_trace():
    async def scenario() -> None:
        slots = FairSlots(1)
        await slots.acquire("A")
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(slots.acquire("B"), 0.05)
        assert slots.waiting == 0
        slots.release()
        assert slots.value == 1                           # not handed to the waiter that left
        await asyncio.wait_for(slots.acquire("C"), 1)

    asyncio.run(scenario())


def test_a_slot_handed_to_a_waiter_cancelled_at_that_moment_passes_on():
    async def scenario() -> None:
        slots = FairSlots(1)
        await slots.acquire("A")
        first = asyncio.create_task(slots.acquire("B"))
        second = asyncio.create_task(slots.acquire("C"))
        await asyncio.sleep(0)
        slots.release()                                   # handed to B ...
        first.cancel()                                    # ... which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.wait_for(second, 1)                 # C got it instead
        assert slots.value == 0 and slots.waiting == 0
        slots.release()
        assert slots.value == 1

    asyncio.run(scenario())
