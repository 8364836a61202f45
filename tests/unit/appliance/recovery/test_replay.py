"""When a failed exchange is waited out, and for how long (appliance/recovery/replay.py)."""

from __future__ import annotations

import asyncio

import pytest

from appliance.core.engine import EngineState
from appliance.core.errors import EngineUnavailable, UpstreamError, engine_lost
from appliance.recovery.replay import Fate, engine_back, engine_died, engine_fault, worker_fate
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.anyio


def test_an_engine_fault_is_a_broken_exchange_or_the_workers_word_that_its_core_died() -> None:
    assert engine_fault(engine_lost(1)) and engine_fault(engine_died())
    assert engine_fault(EngineUnavailable("x", code="engine_unavailable"))
    assert not engine_fault(UpstreamError(500, "a bug", param=None, code="engine_error"))
    assert not engine_fault(UpstreamError(400, "bad", param=None, code="invalid_request"))


def test_the_deaths_words_inside_another_message_are_no_fault() -> None:
    """Only a 500 that is vLLM's EngineDeadError: not one that quotes it (a client's text)."""
    quoted = UpstreamError(500, "bad input: 'EngineCore encountered an issue'", param=None,
                           code="engine_error")
    refused = UpstreamError(400, engine_died().message, param=None, code="invalid_request")
    assert not engine_fault(quoted) and not engine_fault(refused)


async def test_a_loss_is_confirmed_when_the_worker_stops_serving() -> None:
    engine = FakeEngine("http://127.0.0.1:9", healthy=False)
    later = asyncio.get_running_loop().call_later(0.05, engine.set_state, EngineState.STOPPING)
    assert await worker_fate(engine, 1, max_wait_s=5) is Fate.LOST
    later.cancel()


async def test_a_worker_that_answers_its_probe_serves_and_is_not_waited_on() -> None:
    """A failed exchange on a worker that still answers /health is the request's own failure:
    known at once, not after resume.confirm_s."""
    engine = FakeEngine("http://127.0.0.1:9")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await worker_fate(engine, 1, max_wait_s=5) is Fate.SERVING
    assert loop.time() - started < 1


async def test_a_loss_never_declared_is_not_waited_out_past_the_bound() -> None:
    engine = FakeEngine("http://127.0.0.1:9", healthy=False)
    assert await worker_fate(engine, 1, max_wait_s=0.05) is Fate.UNKNOWN


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
