"""Property: whatever body a client sends to the generation routes, the answer is never a 5xx."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from appliance.app import create_app
from appliance.settings import Settings
from tests.unit.appliance.fakes import FakeEngine, upstream

pytestmark = pytest.mark.anyio

scalars = st.none() | st.booleans() | st.integers(-10**12, 10**12) | st.floats(
    allow_nan=False) | st.text(max_size=20)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=8), inner, max_size=4), max_leaves=12)
FIELDS = ["model", "messages", "prompt", "n", "best_of", "max_tokens", "max_completion_tokens",
          "stream", "temperature", "top_p", "tools", "tool_choice", "logprobs", "top_logprobs",
          "truncate_prompt_tokens", "thinking", "chat_template_kwargs", "use_beam_search"]
parts = st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url", "input_audio"])},
                              optional={"text": values, "image_url": values})
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "system", "assistant", "tool", "robot"]) | values},
    optional={"content": st.text(max_size=30) | st.lists(parts, max_size=3) | values}),
    max_size=3)
bodies = st.fixed_dictionaries({}, optional={"messages": messages | values,
                                             **{f: values for f in FIELDS[2:]}})
raw = st.binary(max_size=64) | bodies.map(lambda b: json.dumps(b).encode())


@settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
@given(body=raw, path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]))
async def test_no_body_makes_a_5xx(body: bytes, path: str) -> None:
    async with upstream() as (_, url):
        app = create_app(Settings(), FakeEngine(url))
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://app") as client:
            response = await client.post(path, content=body,
                                         headers={"content-type": "application/json"})
    assert response.status_code < 500, (body, response.text)
    if response.status_code >= 400:
        error: dict[str, Any] = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
