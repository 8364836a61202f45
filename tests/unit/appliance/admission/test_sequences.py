"""Admission counts sequences, not requests (issue 35 #8): a request holds as many slots as its
fan-out, against the global limit and its client's own; a fan-out above a limit outright is
refused at once."""

from __future__ import annotations

import asyncio

import pytest

from appliance.admission.clients import Client
from appliance.admission.slots import Admission
from appliance.core.errors import TooManyRequests
from tests.unit.appliance.admission.test_slots import A, B, C, FakeClock, holders, settle

pytestmark = pytest.mark.anyio


class Batch:
    """A request of `sequences` sequences that holds its slots until told to let go."""

    def __init__(self, admission: Admission, client: Client, sequences: int, log: list[str],
                 name: str) -> None:
        self.release = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(admission, client, sequences, log, name))

    async def _run(self, admission: Admission, client: Client, sequences: int, log: list[str],
                   name: str) -> None:
        async with admission.slot(client, sequences=sequences):
            log.append(name)
            await self.release.wait()


async def test_a_batch_holds_a_slot_per_sequence_and_its_neighbour_waits_for_them() -> None:
    admission = Admission(8, queue_max=4, queue_wait_s=30, clock=FakeClock())
    log: list[str] = []
    async with holders() as made:
        big = Batch(admission, A, 8, log, "batch")
        await settle()
        assert admission.in_flight == 8
        neighbour = Batch(admission, B, 1, log, "neighbour")
        made.extend([big, neighbour])  # type: ignore[list-item]
        await settle()
        assert log == ["batch"] and admission.queued == 1  # queued as eight singles would be
        big.release.set()
        await settle()
        assert log == ["batch", "neighbour"] and admission.in_flight == 1
        neighbour.release.set()
        await settle()
    assert admission.in_flight == 0


async def test_a_client_limit_counts_the_sequences_it_holds() -> None:
    limited = Client("limited", max_inflight=4)
    admission = Admission(64, queue_max=4, queue_wait_s=30, clock=FakeClock())
    async with admission.slot(limited, sequences=3):
        async with admission.slot(limited, sequences=1):
            with pytest.raises(TooManyRequests) as refused:
                async with admission.slot(limited):
                    pass
        assert refused.value.reason == "client_max_inflight"
        assert "4 sequences open" in refused.value.message
        with pytest.raises(TooManyRequests):  # 3 held and 2 asked: over 4
            async with admission.slot(limited, sequences=2):
                pass
    assert admission.in_flight == 0


async def test_freed_slots_go_to_the_head_of_the_queue_once_it_fits_and_nobody_passes_it(
) -> None:
    admission = Admission(8, queue_max=4, queue_wait_s=30, clock=FakeClock())
    log: list[str] = []
    async with holders() as made:
        first, second = Batch(admission, A, 4, log, "a1"), Batch(admission, A, 4, log, "a2")
        await settle()
        wide = Batch(admission, B, 6, log, "wide")
        await settle()
        narrow = Batch(admission, C, 1, log, "narrow")
        await settle()
        made.extend([first, second, wide, narrow])  # type: ignore[list-item]
        first.release.set()
        await settle()
        assert log == ["a1", "a2"] and admission.in_flight == 4  # 1 would fit: not its turn
        second.release.set()
        await settle()
        assert log == ["a1", "a2", "wide", "narrow"] and admission.in_flight == 7
        wide.release.set()
        narrow.release.set()
        await settle()
    assert admission.in_flight == 0


async def test_a_batch_refused_at_the_door_leaves_nothing_held_at_its_client() -> None:
    limited = Client("limited", max_inflight=4)
    admission = Admission(4, clock=FakeClock())  # no queue: refused at once when full
    async with admission.slot(A, sequences=4):
        with pytest.raises(TooManyRequests) as refused:
            async with admission.slot(limited, sequences=4):
                pass
        assert refused.value.reason == "admission"
    async with admission.slot(limited, sequences=4):  # its 4 were never counted as held
        assert admission.in_flight == 4
    assert admission.in_flight == 0
