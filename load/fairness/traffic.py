"""The traffic of the fairness run: steady probes that time their first token, and floods.

A probe client sends streamed chats at a steady rate (open loop: a slow answer does not delay
the next request) and records each one's time to the first non-empty token. A flood keeps a
number of non-streamed requests in flight, each worker sending again as soon as it is answered
(after a short pause on a 429, as a client honouring refusals would).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import Counter
from dataclasses import dataclass, field

import httpx

from load.locust.outcome import percentile

_FIRST_TOKEN = re.compile(r'"(?:content|text)":"[^"]')
RETRY_PAUSE_S = 0.5  # a flood worker's pause after a 429
NO_ANSWER = 0  # the status counted for a request that got no HTTP answer
PROMPT = [{"role": "user", "content": "Write one short sentence about the sea."}]


@dataclass
class Sample:
    """What one client saw in one phase (or several, merged)."""

    ttft_s: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)

    def merge(self, other: Sample) -> None:
        self.ttft_s += other.ttft_s
        self.statuses.update(other.statuses)

    def p(self, q: float) -> float | None:
        return percentile(self.ttft_s, q)

    @property
    def failures(self) -> int:
        """5xx answers and requests that got no answer at all."""
        return sum(count for status, count in self.statuses.items()
                   if status >= 500 or status == NO_ANSWER)


def chat(max_tokens: int, priority: int | None = None, stream: bool = False) -> dict[str, object]:
    body: dict[str, object] = {"messages": PROMPT, "max_tokens": max_tokens, "ignore_eos": True,
                               "stream": stream}
    if priority is not None:  # only when talking to the worker directly
        body["priority"] = priority
    return body


def bearer(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def probe_once(client: httpx.AsyncClient, key: str | None, body: dict[str, object],
                     sample: Sample) -> None:
    try:
        await _timed(client, key, body, sample)
    except httpx.HTTPError:
        sample.statuses[NO_ANSWER] += 1


async def _timed(client: httpx.AsyncClient, key: str | None, body: dict[str, object],
                 sample: Sample) -> None:
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers=bearer(key)) as response:
        sample.statuses[response.status_code] += 1
        first: float | None = None
        async for line in response.aiter_lines():
            if first is None and _FIRST_TOKEN.search(line):
                first = time.perf_counter() - started
    if response.status_code == 200 and first is not None:
        sample.ttft_s.append(first)


async def probes(client: httpx.AsyncClient, key: str | None, count: int, interval_s: float,
                 body: dict[str, object]) -> Sample:
    """`count` streamed requests, one every `interval_s`; their times to first token."""
    sample = Sample()
    sent = []
    for _ in range(count):
        sent.append(asyncio.create_task(probe_once(client, key, body, sample)))
        await asyncio.sleep(interval_s)  # the steady rate itself, not a wait for an event
    await asyncio.gather(*sent)
    return sample


async def flood(client: httpx.AsyncClient, key: str | None, workers: int,
                body: dict[str, object], stop: asyncio.Event) -> Sample:
    """`workers` requests kept in flight until `stop`; the statuses they got."""
    sample = Sample()

    async def worker() -> None:
        while not stop.is_set():
            try:
                response = await client.post("/v1/chat/completions", json=body,
                                             headers=bearer(key))
            except httpx.HTTPError:
                sample.statuses[NO_ANSWER] += 1
                continue
            sample.statuses[response.status_code] += 1
            if response.status_code == 429:
                await asyncio.sleep(RETRY_PAUSE_S)

    tasks = [asyncio.create_task(worker()) for _ in range(workers)]
    await stop.wait()
    for task in tasks:
        task.cancel()  # the client leaves: the appliance aborts what is still running
    await asyncio.gather(*tasks, return_exceptions=True)
    return sample


async def under_flood(url: str, probe_key: str | None, probe_body: dict[str, object],
                      flood_key: str | None, flood_body: dict[str, object], workers: int,
                      count: int, interval_s: float, ramp_s: float) -> tuple[Sample, Sample]:
    """Probes while a flood runs (none when workers is 0); (probe sample, flood sample)."""
    limits = httpx.Limits(max_connections=workers + count + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits,
                                 trust_env=False) as client:
        stop = asyncio.Event()
        flooding = asyncio.create_task(flood(client, flood_key, workers, flood_body, stop))
        if workers:
            await asyncio.sleep(ramp_s)  # let the flood fill the slots and the queue
        measured = await probes(client, probe_key, count, interval_s, probe_body)
        stop.set()
        return measured, await flooding
