"""The smaller edge defects (issue 9 #10): the budget clamp and its header, what the appliance
tells the LAN about itself (server header, the model's path)."""

from __future__ import annotations

import httpx
import pytest

from load.kit.synthetic_worker import MAX_MODEL_LEN
from load.kit.vllm_shapes import REJECT_MARKER
from tests.support.stack import Stack

HI = [{"role": "user", "content": "hi"}]
CLAMP = "x-max-tokens-clamped"


def _chat(stack: Stack, body: dict[str, object]) -> httpx.Response:
    return httpx.post(f"{stack.url}/v1/chat/completions", json=body, timeout=30)


def test_a_budget_of_the_whole_window_is_clamped_with_a_header(stack: Stack) -> None:
    """#10: max_tokens equal to the window with a non-empty prompt is clamped to the room left
    (the header says so), not passed on for vLLM to shorten silently, and not a 400."""
    response = _chat(stack, {"messages": HI, "max_tokens": MAX_MODEL_LEN})
    assert response.status_code == 200, response.text[:300]
    assert response.headers.get(CLAMP, "").startswith(f"requested={MAX_MODEL_LEN}; applied=")
    applied = int(response.headers[CLAMP].split("applied=")[1].split(";")[0])
    assert 0 < applied < MAX_MODEL_LEN


def test_a_budget_that_fits_passes_unclamped(stack: Stack) -> None:
    """Guard: a budget the window holds is forwarded as is, without the header."""
    response = _chat(stack, {"messages": HI, "max_tokens": 100})
    assert response.status_code == 200
    assert CLAMP not in response.headers


def test_a_400_carries_no_clamp_header(stack: Stack) -> None:
    """#10: a request refused for another reason after its budget was clamped is a 400
    without the clamp header (nothing was clamped for the client)."""
    body = {"messages": [{"role": "user", "content": REJECT_MARKER}], "max_tokens": 1_000_000}
    response = _chat(stack, body)
    assert response.status_code == 400
    assert CLAMP not in response.headers


def test_models_does_not_show_the_model_directory(stack: Stack) -> None:
    """#10: /v1/models lists the served name; no absolute path of the model directory."""
    response = httpx.get(f"{stack.url}/v1/models", timeout=10)
    assert response.status_code == 200
    for model in response.json()["data"]:
        assert not str(model.get("root") or "").startswith("/"), model
        assert not any(str(value).startswith("/") for value in model.values()), model


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/livez"), ("GET", "/health"), ("GET", "/metrics"), ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"), ("GET", "/no-such-route"),
])
def test_no_server_or_version_header(stack: Stack, method: str, path: str) -> None:
    """#10: no `server` header naming the software or a version, on any route (none at all,
    or a bare product name of the appliance's choosing)."""
    response = httpx.request(method, f"{stack.url}{path}", timeout=30,
                             json={"messages": HI, "max_tokens": 2} if method == "POST" else None)
    server = response.headers.get("server", "")
    assert "uvicorn" not in server.lower() and not any(c.isdigit() for c in server), server
