"""The API's uvicorn server as serve runs it: dated answers, and a stop that is prompt though
its main loop wakes only once a second."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import pytest
import uvicorn

from appliance.fences.uvicorn import ApiServer
from tests.net import free_port
from tests.unit.appliance.fakes import eventually

pytestmark = pytest.mark.anyio


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


async def test_answers_are_dated_and_stop_is_prompt() -> None:
    port = free_port()
    server = ApiServer(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                    lifespan="off"))
    task = asyncio.create_task(server.serve())
    await eventually(lambda: server.started)
    async with httpx.AsyncClient(trust_env=False) as client:
        response = await client.get(f"http://127.0.0.1:{port}/")
    assert response.text == "ok" and "date" in response.headers
    await asyncio.sleep(0.3)  # inside a one-second wait of the main loop
    started = time.monotonic()
    server.stop()
    await asyncio.wait_for(task, 5)
    assert time.monotonic() - started < 0.5
