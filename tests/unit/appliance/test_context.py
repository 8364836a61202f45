"""Trace hand-off: a client's W3C traceparent reaches the worker and its trace id tags the log."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from appliance.app import create_app
from appliance.core.context import add_request_fields, request_context
from appliance.core.settings import Settings
from load.kit.synthetic_worker import SyntheticWorker
from tests.unit.appliance.fakes import FakeEngine, free_port, serving

pytestmark = pytest.mark.anyio
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"


async def bound_context(headers: dict[str, str]) -> dict[str, Any]:
    """What a log line of a request with `headers` is given by request_context's binding."""
    seen: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        seen.update(add_request_fields(None, "info", {}))
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    transport = httpx.ASGITransport(app=request_context(app))
    async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
        await client.get("/", headers=headers)
    return seen


async def test_a_valid_traceparent_binds_its_trace_id_with_the_request_id() -> None:
    seen = await bound_context({"traceparent": TRACEPARENT, "x-request-id": "req-1"})
    assert seen == {"request_id": "req-1", "trace_id": TRACE_ID}


@pytest.mark.parametrize("value", [
    "garbage",
    f"ff-{TRACE_ID}-00f067aa0ba902b7-01",  # version ff is forbidden
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # all-zero trace id
    f"00-{TRACE_ID}-0000000000000000-01",  # all-zero parent id
    f"00-{TRACE_ID.upper()}-00f067aa0ba902b7-01",  # upper-case hex
])
async def test_an_invalid_traceparent_binds_no_trace_id(value: str) -> None:
    seen = await bound_context({"traceparent": value})
    assert "trace_id" not in seen and "request_id" in seen


async def test_traceparent_and_tracestate_are_passed_to_the_worker() -> None:
    synthetic = SyntheticWorker(4, 0.0, "synthetic")
    received: list[dict[str, str]] = []

    async def worker(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/v1/chat/completions":
            received.append({k.decode(): v.decode() for k, v in scope["headers"]})
        await synthetic(scope, receive, send)

    worker_port, port = free_port(), free_port()
    app = create_app(Settings(), FakeEngine(f"http://127.0.0.1:{worker_port}"))
    async with serving(worker, worker_port), serving(app, port), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        response = await client.post("/v1/chat/completions", headers={
            "traceparent": TRACEPARENT, "tracestate": "vendor=value"},
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert response.status_code == 200
    assert received[-1]["traceparent"] == TRACEPARENT
    assert received[-1]["tracestate"] == "vendor=value"
