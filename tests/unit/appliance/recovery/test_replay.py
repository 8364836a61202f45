"""When a failed exchange is waited out, and for how long (appliance/recovery/replay.py)."""

from __future__ import annotations

import asyncio

import pytest

from appliance.engine import EngineState
from appliance.errors import EngineUnavailable, UpstreamError, engine_lost
from appliance.recovery.replay import engine_back, engine_died, engine_fault, loss_confirmed
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.anyio


def test_an_engine_fault_is_a_broken_exchange_or_the_workers_word_that_its_core_died() -> None:
    assert engine_fault(engine_lost(1)) and engine_fault(engine_died())
    assert engine_fault(EngineUnavailable("x", code="engine_unavailable"))
    assert not engine_fault(UpstreamError(500, "a bug", param=None, code="engine_error"))
    assert not engine_fault(UpstreamError(400, "bad", param=None, code="invalid_request"))


async def test_a_loss_is_confirmed_when_the_worker_stops_serving() -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    later = asyncio.get_running_loop().call_later(0.05, engine.set_state, EngineState.STOPPING)
    assert await loss_confirmed(engine, 1, max_wait_s=5)
    later.cancel()


async def test_a_loss_never_declared_is_not_waited_out_past_the_bound() -> None:
    engine = FakeEngine("http://127.0.0.1:9")
    assert not await loss_confirmed(engine, 1, max_wait_s=0.05)


async def test_the_engine_is_back_once_a_newer_worker_serves() -> None:
    engine = FakeEngine("http://127.0.0.1:9", state=EngineState.STOPPING)
    loop = asyncio.get_running_loop()
    loop.call_later(0.02, engine.set_state, EngineState.STARTING, 2)
    loop.call_later(0.04, engine.set_state, EngineState.READY)
    assert await engine_back(engine, 1, max_wait_s=5)
    assert engine.serial == 2


async def test_no_wait_when_nothing_will_come_back() -> None:
    for state in (EngineState.FAILED, EngineState.STOPPED):
        assert not await engine_back(FakeEngine("http://127.0.0.1:9", state=state), 1, 5)
    stopping = FakeEngine("http://127.0.0.1:9", state=EngineState.BACKOFF, stop_requested=True)
    assert not await engine_back(stopping, 1, 5)
    slow = FakeEngine("http://127.0.0.1:9", state=EngineState.STARTING, serial=2)
    assert not await engine_back(slow, 1, max_wait_s=0.05)  # never ready in time
