"""Questions the supervisor asks the worker over HTTP, on a thread of their own.

The probes share no fate with the API: they run on an event loop of their own, on a thread of
their own, with the worker client's own pool of connections (appliance/core/upstream.py, the one
client to the worker), so a stalled serving loop (a huge body being parsed, a flood of clients)
can delay when a verdict is read but never makes a healthy worker look dead.

What a probe costs the appliance is mostly waking that thread and running its loop once more
(its exchange is a dozen syscalls on one kept-alive connection), so the loop is uvloop's, as the
serving one, /metrics is read for the series the monitors need alone, and each probe goes to
the thread and back in one call each way (`_on_thread`). load.bench.cpu measures what they cost.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

import structlog

from appliance.core.errors import ApiError
from appliance.core.upstream import Limits, Upstream, loop_factory
from appliance.fences.vllm import METRICS_PATH
from supervisor.engine.stats import EngineStats, parse_engine_stats

log = structlog.get_logger("supervisor.engine.probe")

T = TypeVar("T")

_CONNECTIONS = 3  # health, progress and the correctness canary can ask at once
_KEEPALIVE_S = 4.0  # under uvicorn's 5 s: the worker never closes one we are about to use


class HttpProber:
    """Probes the worker at one address; every call has its own timeout and never raises."""

    def __init__(self, base_url: str, model_name: str, timeout_s: float) -> None:
        self._model = model_name
        self._timeout = timeout_s
        self._loop = (loop_factory() or asyncio.new_event_loop)()
        self._thread = threading.Thread(target=self._loop.run_forever, name="probe", daemon=True)
        self._thread.start()
        limits = Limits(connect_timeout_s=timeout_s, read_timeout_s=timeout_s,
                        keepalive_s=_KEEPALIVE_S, max_connections=_CONNECTIONS)
        self._client = self._on_thread_now(self._make_client(base_url, limits))

    async def healthy(self) -> bool:
        """vLLM's /health is 200 (a hung engine can still pass this: progress catches that)."""
        return await self._ok("GET", "/health")

    async def serving(self) -> bool:
        """/health and /v1/models both answer: the model is loaded and the API routes are up."""
        return await self.healthy() and await self._ok("GET", "/v1/models")

    async def canary(self, timeout_s: float) -> bool:
        """A one-token completion: proof that the engine decodes, not only that HTTP answers."""
        body = {"model": self._model, "prompt": "Hi", "max_tokens": 1, "temperature": 0}
        return await self._ok("POST", "/v1/completions", json.dumps(body).encode(), timeout_s)

    async def engine_stats(self) -> EngineStats | None:
        """The worker's series that progress reads, not its whole /metrics page (~65 KB, which
        its server renders for each read); None if it did not answer."""
        answer = await self._request("GET", METRICS_PATH)
        if answer is None or answer[0] != 200:
            return None
        return parse_engine_stats(answer[1].decode("utf-8", "replace"))

    async def ask(self, method: str, path: str, body: bytes | None,
                  timeout_s: float) -> tuple[int, bytes] | None:
        """Any other question (the correctness canary's): status and body, or None."""
        return await self._request(method, path, body, timeout_s)

    async def aclose(self) -> None:
        if self._loop.is_closed():
            return
        await self._on_thread(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        await asyncio.to_thread(self._thread.join)
        self._loop.close()

    async def _ok(self, method: str, path: str, body: bytes | None = None,
                  timeout_s: float | None = None) -> bool:
        answer = await self._request(method, path, body, timeout_s)
        return answer is not None and answer[0] == 200

    async def _request(self, method: str, path: str, body: bytes | None = None,
                       timeout_s: float | None = None) -> tuple[int, bytes] | None:
        """Status and body, or None on any failure (the client logged it at debug)."""
        timeout = self._timeout if timeout_s is None else timeout_s
        try:
            return await self._on_thread(self._client.fetch(method, path, body, timeout))
        except ApiError:
            return None

    async def _on_thread(self, work: Coroutine[Any, Any, T]) -> T:
        """`work` run as a task on the probe loop; its outcome comes back in one call on the
        caller's loop, and a cancelled caller cancels it. A wake-up each way and nothing more:
        `run_coroutine_threadsafe` with `wrap_future` chains a concurrent future between two
        asyncio ones (about forty-five Python calls and five lock rounds a probe, over a quarter
        of what the probe thread ran for /health)."""
        caller = asyncio.get_running_loop()
        outcome: asyncio.Future[T] = caller.create_future()
        started: list[asyncio.Task[T]] = []

        def start() -> None:  # on the probe thread
            task = self._loop.create_task(work)
            started.append(task)
            task.add_done_callback(lambda done: _hand_back(caller, outcome, done))

        self._loop.call_soon_threadsafe(start)
        try:
            return await outcome
        except asyncio.CancelledError:
            # After `start` on the probe loop's queue, so the task exists when this runs.
            self._loop.call_soon_threadsafe(lambda: started[0].cancel())
            raise

    def _on_thread_now(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result()

    @staticmethod
    async def _make_client(base_url: str, limits: Limits) -> Upstream:
        """Made on the probe loop, where its pool lives."""
        return Upstream(base_url, limits, retry_after_s=lambda: 1, quiet=True)


def _hand_back(caller: asyncio.AbstractEventLoop, outcome: asyncio.Future[T],
               done: asyncio.Task[T]) -> None:
    """On the probe thread: `done`'s outcome to `outcome`, on the caller's loop."""
    with contextlib.suppress(RuntimeError):  # the caller's loop closed first (shutdown)
        caller.call_soon_threadsafe(_settle, outcome, done)


def _settle(outcome: asyncio.Future[T], done: asyncio.Task[T]) -> None:
    # The exception is read even when the caller was cancelled meanwhile: a task's exception
    # nobody read is logged as an error when the task is collected.
    exc = None if done.cancelled() else done.exception()
    if outcome.done():  # the caller was cancelled meanwhile
        return
    if done.cancelled():
        outcome.cancel()
    elif exc is not None:
        outcome.set_exception(exc)
    else:
        outcome.set_result(done.result())
