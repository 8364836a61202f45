"""A generation route's body, read from ASGI's receive: JSON only, bounded in size."""

from __future__ import annotations

from typing import Any

import pytest
from litestar import Request

from appliance.core.errors import ApiError
from appliance.core.sections import ServerSettings
from appliance.routes.generation import read_json_body

pytestmark = pytest.mark.anyio
LIMIT = 2048
JSON = (b"content-type", b"application/json")


class Client:
    """ASGI messages as a client's body arrives, counted as the route reads them."""

    def __init__(self, *messages: dict[str, Any]) -> None:
        self.messages = list(messages)
        self.read = 0

    async def receive(self) -> dict[str, Any]:
        self.read += 1
        return self.messages.pop(0)


def part(body: bytes, more: bool = True) -> dict[str, Any]:
    return {"type": "http.request", "body": body, "more_body": more}


async def read(client: Client, *headers: tuple[bytes, bytes]) -> bytes:
    scope: Any = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
                  "headers": [JSON, *headers], "state": {}}
    return await read_json_body(Request(scope, client.receive),  # type: ignore[arg-type]
                                ServerSettings(max_body_bytes=LIMIT))


async def test_a_body_in_pieces_is_read_whole() -> None:
    client = Client(part(b'{"a":'), part(b""), part(b" 1}", more=False))
    assert await read(client) == b'{"a": 1}'
    assert client.read == 3


async def test_a_declared_length_over_the_limit_is_refused_before_any_read() -> None:
    client = Client(part(b"x" * 10, more=False))
    with pytest.raises(ApiError) as refused:
        await read(client, (b"content-length", str(LIMIT + 1).encode()))
    assert (refused.value.status, refused.value.code) == (413, "body_too_large")
    assert client.read == 0


async def test_a_body_without_a_length_is_refused_once_its_bytes_pass_the_limit() -> None:
    """Chunked: nothing to refuse it by up front; it is not read past the piece that passes."""
    client = Client(*(part(b"x" * 1000) for _ in range(5)), part(b"}", more=False))
    with pytest.raises(ApiError) as refused:
        await read(client)
    assert (refused.value.status, refused.value.code) == (413, "body_too_large")
    assert client.read == 3


async def test_a_client_gone_before_its_body_ended_is_its_own_mistake() -> None:
    client = Client(part(b'{"a":'), {"type": "http.disconnect"})
    with pytest.raises(ApiError) as refused:
        await read(client)
    assert (refused.value.status, refused.value.code) == (400, "body_incomplete")


async def test_a_body_that_is_not_json_is_refused_unread() -> None:
    client = Client(part(b"a=1", more=False))
    with pytest.raises(ApiError) as refused:
        await read_json_body(Request({"type": "http", "headers": [], "state": {}},  # type: ignore[typeddict-item]
                                     client.receive), ServerSettings())
    assert refused.value.code == "unsupported_media_type"
    assert client.read == 0
