"""The API's uvicorn server as serve runs it: dated answers, and a stop that is prompt though
its main loop wakes only once a second."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import pytest
import uvicorn

from appliance.fences.uvicorn import ApiServer
from load.kit.net import free_port
from tests.unit.appliance.fakes import eventually

pytestmark = pytest.mark.anyio
MAIN_LOOP_WAIT_S = 1.0  # _Server.main_loop's wait between ticks
HOUR_S = 3600.0


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_answers_are_dated_and_stop_wakes_the_main_loop(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """stop() ends the main loop's wait itself: with that wait stretched to an hour, serve()
    still returns (the promptness, in seconds, is not this test's to time)."""
    real_timeout = asyncio.timeout
    monkeypatch.setattr(asyncio, "timeout", lambda delay: real_timeout(
        HOUR_S if delay == MAIN_LOOP_WAIT_S else delay))
    port = free_port()
    server = ApiServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                    lifespan="off"))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
    assert response.text == "ok" and "date" in response.headers
    await asyncio.sleep(0.3)  # inside a wait of the main loop
    server.stop()
    await asyncio.wait_for(task, 30)  # "never", next to the hour a missed wake-up would take
