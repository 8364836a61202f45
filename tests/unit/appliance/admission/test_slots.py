"""Admission: slots, the fair queue behind them, per-client limits, and every way out of a wait."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from appliance.admission.clients import Client
from appliance.admission.slots import Admission
from appliance.core.errors import TooManyRequests

pytestmark = pytest.mark.anyio
A, B, C = Client("a"), Client("b"), Client("c")


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Holder:
    """A request that holds its slot until told to let go; records when it was admitted."""

    def __init__(self, admission: Admission, client: Client, log: list[str], name: str) -> None:
        self.release = asyncio.Event()
        self.admitted = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(admission, client, log, name))

    async def _run(self, admission: Admission, client: Client, log: list[str], name: str) -> None:
        async with admission.slot(client):
            log.append(name)
            self.admitted.set()
            await self.release.wait()


async def settle() -> None:
    """Let every ready task run until it blocks (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


@contextlib.asynccontextmanager
async def holders() -> AsyncIterator[list[Holder]]:
    made: list[Holder] = []
    try:
        yield made
    finally:
        for holder in made:
            holder.task.cancel()
        await asyncio.gather(*(h.task for h in made), return_exceptions=True)


async def test_within_the_limit_a_slot_is_taken_at_once_and_given_back_on_exit() -> None:
    admission = Admission(2, queue_max=4, queue_wait_s=10)
    async with admission.slot(A):
        assert admission.in_flight == 1
    assert admission.in_flight == 0 and admission.queued == 0


async def test_without_a_queue_the_request_beyond_the_limit_is_refused_at_once() -> None:
    admission = Admission(1)
    async with admission.slot(A):
        with pytest.raises(TooManyRequests) as refused:
            async with admission.slot(B):
                pass
    assert refused.value.reason == "admission" and refused.value.retry_after_s == 1


async def test_waiters_are_admitted_by_priority_then_in_turn_across_clients() -> None:
    admission = Admission(1, queue_max=10, queue_wait_s=30)
    log: list[str] = []
    urgent = Client("urgent", priority=-5)
    async with holders() as made:
        made.append(Holder(admission, A, log, "first"))
        await settle()
        for name, client in (("a1", A), ("a2", A), ("a3", A), ("b1", B), ("u1", urgent),
                             ("c1", C)):
            made.append(Holder(admission, client, log, name))
            await settle()
        assert admission.queued == 6 and admission.in_flight == 1
        for holder in made:
            holder.release.set()
            await settle()
        assert log == ["first", "u1", "a1", "b1", "c1", "a2", "a3"]
    assert admission.in_flight == 0


async def test_a_request_not_admitted_within_its_wait_is_429_with_a_retry_after() -> None:
    admission = Admission(1, queue_max=4, queue_wait_s=0.05)
    async with admission.slot(A):
        with pytest.raises(TooManyRequests) as refused:
            async with admission.slot(B):
                pass
    assert refused.value.reason == "queue_timeout"
    assert "admission.queue_wait_s" in refused.value.message
    assert refused.value.retry_after_s is not None and refused.value.retry_after_s >= 1
    assert admission.queued == 0 and admission.in_flight == 0


async def test_a_cancelled_waiter_leaves_the_queue_and_holds_no_slot() -> None:
    """The Relay's Watch cancels the owning task on disconnect or engine loss."""
    admission = Admission(1, queue_max=4, queue_wait_s=30)
    log: list[str] = []
    async with holders() as made:
        made.append(Holder(admission, A, log, "holder"))
        await settle()
        made.append(Holder(admission, B, log, "gone"))
        made.append(Holder(admission, C, log, "next"))
        await settle()
        made[1].task.cancel()
        await settle()
        assert admission.queued == 1
        made[0].release.set()
        await settle()
        assert log == ["holder", "next"] and admission.in_flight == 1
        made[2].release.set()
        await settle()
    assert admission.in_flight == 0


async def test_a_slot_handed_over_as_its_waiter_is_cancelled_passes_to_the_next() -> None:
    admission = Admission(1, queue_max=4, queue_wait_s=30)
    log: list[str] = []
    first = admission.slot(A)
    await first.__aenter__()
    async with holders() as made:
        made.append(Holder(admission, B, log, "unlucky"))
        made.append(Holder(admission, C, log, "next"))
        await settle()
        await first.__aexit__(None, None, None)  # hands the slot to "unlucky" ...
        made[0].task.cancel()  # ... which is cancelled before it runs again
        await settle()
        assert log == ["next"] and admission.in_flight == 1
        made[1].release.set()
        await settle()
    assert admission.in_flight == 0 and admission.queued == 0


async def test_a_full_queue_drops_the_heaviest_clients_newest_waiter_for_a_lighter_one() -> None:
    admission = Admission(1, queue_max=3, queue_wait_s=30)
    log: list[str] = []
    async with holders() as made:
        made.append(Holder(admission, A, log, "holder"))
        await settle()
        for name in ("a1", "a2", "a3"):
            made.append(Holder(admission, A, log, name))
        await settle()
        made.append(Holder(admission, B, log, "b1"))
        await settle()
        with pytest.raises(TooManyRequests) as dropped:
            await made[3].task
        assert dropped.value.reason == "queue_full" and admission.queued == 3
        with pytest.raises(TooManyRequests) as refused:  # a's own next one: a is the heaviest
            async with admission.slot(A):
                pass
        assert refused.value.reason == "queue_full"
        for holder in made:
            holder.release.set()
            await settle()
        assert log == ["holder", "a1", "b1", "a2"]


async def test_a_client_at_its_max_inflight_is_refused_at_once_naming_the_limit() -> None:
    admission = Admission(8, queue_max=8, queue_wait_s=30)
    limited = Client("batch", max_inflight=2)
    async with admission.slot(limited), admission.slot(limited):
        with pytest.raises(TooManyRequests) as refused:
            async with admission.slot(limited):
                pass
        async with admission.slot(B):  # others are not held back by it
            pass
    error = refused.value
    assert error.reason == "client_max_inflight" and "max_inflight 2" in error.message
    assert "'batch'" in error.message and error.retry_after_s == 1
    async with admission.slot(limited):  # the limit counts what is open now
        pass


async def test_a_client_over_its_tokens_per_minute_waits_until_the_bucket_refills() -> None:
    clock = FakeClock()
    admission = Admission(8, clock=clock)
    metered = Client("meter", tokens_per_minute=600)  # 10 tokens a second
    async with admission.slot(metered) as meter:
        meter.sending(900)  # 300 over: 30 s of refill before the level is above zero
    with pytest.raises(TooManyRequests) as refused:
        async with admission.slot(metered):
            pass
    error = refused.value
    assert error.reason == "client_tokens_per_minute" and "600 tokens per minute" in error.message
    assert error.retry_after_s == 31 and "resets in 31 s" in error.message
    clock.now += 30.5
    async with admission.slot(metered) as meter:
        assert meter.enabled


async def test_an_unmetered_client_has_no_meter_to_feed() -> None:
    admission = Admission(8)
    async with admission.slot(A) as meter:
        assert not meter.enabled


async def test_retry_after_follows_the_queue_and_the_mean_time_a_slot_is_held() -> None:
    clock = FakeClock()
    admission = Admission(2, queue_max=10, queue_wait_s=30, clock=clock)
    for _ in range(20):
        async with admission.slot(A):
            clock.now += 4.0
    assert admission.mean_hold_s == pytest.approx(4.0, rel=0.05)
    assert admission.retry_after_s() == 2  # one request ahead of nobody: half a hold, rounded up
    log: list[str] = []
    async with holders() as made:
        for i in range(2 + 5):
            made.append(Holder(admission, Client(f"c{i}"), log, str(i)))
        await settle()
        assert admission.queued == 5
        assert admission.retry_after_s() == 12  # 6 slots' worth at 2 at a time, 4 s each


async def test_a_better_priority_takes_a_headroom_slot_instead_of_waiting() -> None:
    admission = Admission(1, queue_max=8, queue_wait_s=30, headroom=1)
    log: list[str] = []
    low, high = Client("low", priority=5), Client("high", priority=-1)
    async with holders() as made:
        made.append(Holder(admission, low, log, "low-holder"))
        made.append(Holder(admission, low, log, "low-waiter"))
        await settle()
        made.append(Holder(admission, high, log, "high1"))
        await settle()
        assert log == ["low-holder", "high1"] and admission.in_flight == 2
        made.append(Holder(admission, high, log, "high2"))  # the headroom is taken: it waits
        await settle()
        assert admission.queued == 2
        made[2].release.set()  # high1 leaves: its headroom slot goes to high2, not to low
        await settle()
        assert log[-1] == "high2" and admission.in_flight == 2
        made[3].release.set()  # high2 leaves: nobody may have the headroom slot
        await settle()
        assert admission.in_flight == 1 and admission.queued == 1
        made[0].release.set()  # the low holder leaves: the low waiter's turn
        await settle()
        assert log == ["low-holder", "high1", "high2", "low-waiter"]
        made[1].release.set()
        await settle()
    assert admission.in_flight == 0


async def test_without_headroom_a_better_priority_waits_first_in_line() -> None:
    admission = Admission(1, queue_max=8, queue_wait_s=30)
    log: list[str] = []
    async with holders() as made:
        for name, client in (("holder", A), ("a", A), ("high", Client("high", priority=-1))):
            made.append(Holder(admission, client, log, name))
            await settle()
        assert admission.in_flight == 1 and admission.queued == 2
        for holder in made:
            holder.release.set()
            await settle()
        assert log == ["holder", "high", "a"]
