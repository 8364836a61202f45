"""The cost abort through the whole app, over the synthetic worker: a constrained stream whose
tokens come far slower than the norm beside another request ends with `request_too_costly` in
its protocol's ending, and its client is charged what it streamed (honest metering)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from appliance.app import create_app
from appliance.core.settings import Settings
from tests.unit.appliance.fakes import FakeEngine, eventually, free_port, serving, upstream

pytestmark = pytest.mark.anyio
KEYS = {"costly": "sk-costly", "peer": "sk-peer"}
SLOW_TOKENS = 60  # each costly request streams this many tokens and one more before its abort
COSTLY = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1000, "stream": True,
          "structured_outputs": {"grammar": "root ::= [a-z]+"}}
# Not streamed: its tokens are never timed, so the norm stays at its floor whenever the costly
# ones arrive (a streamed peer alone at the engine feeds the norm its own 10 ms a token, and a
# costly request that comes after two of them is no slower than that norm). The costly streams
# condemn themselves by their own gaps, the peer beside them at the engine.
PEER = {key: value for key, value in COSTLY.items() if key != "structured_outputs"} | {
    "stream": False}


@contextlib.asynccontextmanager
async def appliance(url: str) -> AsyncIterator[httpx.AsyncClient]:
    # Every synthetic token (10 ms) is far above a norm of 1 ms: the constrained one is costly.
    settings = Settings(
        admission={"clients": [{"name": "costly", "key": KEYS["costly"], "tokens_per_minute": 200},
                               {"name": "peer", "key": KEYS["peer"]}]},
        constraints={"slow_norm_floor_s": 0.001, "slow_factor": 2.0, "slow_tokens": SLOW_TOKENS})
    port = free_port()
    async with serving(create_app(settings, FakeEngine(url)), port, settings), httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
        yield client


async def stream_as(client: httpx.AsyncClient, who: str,
                    body: dict[str, object]) -> tuple[int, list[str]]:
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"Authorization": f"Bearer {KEYS[who]}"}) as response:
        lines = [line async for line in response.aiter_lines() if line.startswith("data:")]
        return response.status_code, lines


async def test_a_costly_stream_is_cut_and_charged_the_tokens_it_streamed() -> None:
    """200 tokens a minute and a prompt of a few: charged its prompt alone, a costly request
    would be let in dozens of times; charged the 61 tokens each one streamed, four at most."""
    admitted = 0
    async with upstream(tokens=1000, delay=0.01) as (fake, url), appliance(url) as client:
        peer = asyncio.ensure_future(stream_as(client, "peer", PEER))
        await eventually(lambda: fake.running == 1)
        for _ in range(12):
            status, lines = await stream_as(client, "costly", COSTLY)
            if status == 429:
                break
            admitted += 1
            end = json.loads(lines[-2].removeprefix("data: "))
            assert end["error"]["code"] == "request_too_costly", lines[-3:]
            assert len(lines) >= SLOW_TOKENS + 2 and lines[-1] == "data: [DONE]"
        peer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await peer
    assert status == 429 and 2 <= admitted <= 4, (status, admitted)
