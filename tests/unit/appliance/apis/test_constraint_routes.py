"""A costly output constraint is refused on every route that can carry one, in that route's
error shape, before the worker is asked."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.appliance.fakes import FakeEngine, appliance, upstream

pytestmark = pytest.mark.anyio
HI = [{"role": "user", "content": "hi"}]
NESTED = "(a+)+$"
SCHEMA = {"type": "object", "properties": {"s": {"type": "string", "pattern": NESTED}}}


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": HI, "structured_outputs": {"regex": NESTED}},
     "structured_outputs.regex"),
    ("/v1/completions", {"prompt": "hi", "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     "response_format.json_schema.schema"),
    ("/v1/responses", {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x",
                                                          "schema": SCHEMA}}},
     "text.format.schema"),
    ("/v1/messages", {"messages": HI, "max_tokens": 4, "output_config": {
        "format": {"type": "json_schema", "schema": SCHEMA}}}, "output_config.format.schema"),
    ("/v1/chat/completions/batch", {"messages": [HI], "structured_outputs": {
        "grammar": 'root ::= ("a"+)+'}}, "structured_outputs.grammar"),
])
async def test_a_costly_constraint_is_400_in_the_routes_shape_and_never_sent(
        path: str, body: dict[str, Any], param: str) -> None:
    async with upstream() as (fake, url), appliance(FakeEngine(url)) as client:
        response = await client.post(path, json={"model": "synthetic"} | body)
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        if path == "/v1/messages":  # Anthropic's shape: no param, the message names it
            assert response.json()["type"] == "error" and param in error["message"]
        else:
            assert error["param"] == param and error["code"] == "constraint_too_complex"
        assert fake.received == []
