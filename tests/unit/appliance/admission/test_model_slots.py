"""A model's own admission cap (`max_inflight` in its table): its requests beyond it wait in
its own line and never hold up another model's; the box's limit and the clients' still hold."""

from __future__ import annotations

import asyncio

import pytest

from appliance.admission.clients import Client
from appliance.admission.slots import Admission
from appliance.core.errors import BadRequest, TooManyRequests

pytestmark = pytest.mark.anyio
A, B = Client("a"), Client("b")


async def settle() -> None:
    """Let every ready task run until it blocks (no time passes)."""
    for _ in range(10):
        await asyncio.sleep(0)


class Holder:
    """A request that holds its slots until told to let go."""

    def __init__(self, admission: Admission, client: Client = A, sequences: int = 1) -> None:
        self.release = asyncio.Event()
        self.admitted = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(admission, client, sequences))

    async def _run(self, admission: Admission, client: Client, sequences: int) -> None:
        async with admission.slot(client, sequences=sequences):
            self.admitted.set()
            await self.release.wait()

    async def done(self) -> None:
        self.release.set()
        await asyncio.wait_for(self.task, 5)


async def test_a_request_beyond_its_models_cap_waits_and_another_models_passes_it() -> None:
    admission = Admission(8, queue_max=4, queue_wait_s=10)
    gemma, smol = admission.for_model("gemma", 1), admission.for_model("smol", None)
    first = Holder(gemma)
    await settle()
    second = Holder(gemma, B)
    await settle()
    assert first.admitted.is_set() and not second.admitted.is_set()
    assert gemma.model_detail() == {"max_inflight": 1, "in_flight": 1, "queued": 1}
    assert admission.in_flight == 1 and admission.queued == 1  # the box sees the wait too
    others = [Holder(smol) for _ in range(3)]  # a queue for gemma holds none of smol's up
    await settle()
    assert all(other.admitted.is_set() for other in others) and admission.in_flight == 4
    await first.done()
    await settle()
    assert second.admitted.is_set() and gemma.model_detail() == {
        "max_inflight": 1, "in_flight": 1, "queued": 0}
    for holder in (second, *others):
        await holder.done()
    assert admission.in_flight == 0 and gemma.model_detail() == {
        "max_inflight": 1, "in_flight": 0, "queued": 0}
    assert smol is admission and smol.model_detail() is None  # no cap: no line of its own


async def test_without_a_queue_a_request_beyond_its_models_cap_is_a_429_naming_it() -> None:
    gemma = Admission(8).for_model("gemma", 2)
    first = Holder(gemma, sequences=2)
    await settle()
    with pytest.raises(TooManyRequests) as refused:
        async with gemma.slot(B):
            pass
    assert refused.value.code == "model_max_inflight" and refused.value.retry_after_s == 1
    assert "models.gemma.max_inflight" in refused.value.message
    await first.done()


async def test_a_wait_at_the_models_cap_ends_in_time_with_a_429() -> None:
    gemma = Admission(8, queue_max=4, queue_wait_s=0.2).for_model("gemma", 1)
    first = Holder(gemma)
    await settle()
    with pytest.raises(TooManyRequests) as refused:
        async with gemma.slot(B):
            pass
    assert refused.value.code == "model_admission_timeout"
    assert "not admitted within 0.2 s" in refused.value.message
    assert gemma.model_detail() == {"max_inflight": 1, "in_flight": 1, "queued": 0}
    await first.done()


async def test_the_box_limit_still_holds_for_a_model_under_its_cap() -> None:
    admission = Admission(2)
    gemma, smol = admission.for_model("gemma", 5), admission.for_model("smol", 5)
    held = [Holder(gemma), Holder(smol)]
    await settle()
    with pytest.raises(TooManyRequests) as refused:
        async with gemma.slot(B):
            pass
    assert refused.value.code == "too_many_requests"  # the box's, not the model's
    assert gemma.model_detail() == {"max_inflight": 5, "in_flight": 1, "queued": 0}
    for holder in held:
        await holder.done()


async def test_a_clients_limit_holds_across_models_and_counts_its_wait_at_a_cap() -> None:
    admission = Admission(8, queue_max=4, queue_wait_s=10)
    gemma, smol = admission.for_model("gemma", 1), admission.for_model("smol", 1)
    limited = Client("limited", max_inflight=2)
    first = Holder(gemma, limited)
    await settle()
    waiting = Holder(gemma, limited)  # at gemma's cap: waits, counted against its client
    await settle()
    with pytest.raises(TooManyRequests) as refused:
        async with smol.slot(limited):
            pass
    assert refused.value.code == "client_max_inflight"
    await first.done()
    await settle()
    assert waiting.admitted.is_set()
    await waiting.done()


async def test_a_fan_out_above_the_models_cap_is_a_400_not_a_wait() -> None:
    gemma = Admission(8, queue_max=4, queue_wait_s=10).for_model("gemma", 2)
    with pytest.raises(BadRequest) as refused:
        async with gemma.slot(A, sequences=3):
            pass
    assert refused.value.code == "too_many_sequences"
    assert "models.gemma.max_inflight, 2" in refused.value.message
    assert gemma.model_detail() == {"max_inflight": 2, "in_flight": 0, "queued": 0}


async def test_a_waiter_at_the_cap_that_leaves_passes_the_slot_on() -> None:
    gemma = Admission(8, queue_max=4, queue_wait_s=10).for_model("gemma", 1)
    first = Holder(gemma)
    await settle()
    gone, third = Holder(gemma, B), Holder(gemma, B)
    await settle()
    gone.task.cancel()
    await settle()
    await first.done()
    await settle()
    assert third.admitted.is_set() and not gone.admitted.is_set()
    await third.done()
    assert gemma.model_detail() == {"max_inflight": 1, "in_flight": 0, "queued": 0}
