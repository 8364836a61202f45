"""One generation request from admission to its last byte, as the ASGI app its handler returns.

The Relay is the single owner of everything a request holds: its admission slot, its upstream
exchange and its watch (client gone, engine lost), all released by leaving one `async with`.
It answers every outcome itself, in the route's error shape: before the head a plain error
answer, after it the protocol's own stream ending, so no request is left without an end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from litestar.types import Message, Receive, Scope, Send

from appliance.admission.slots import Admission
from appliance.admission.usage import Meter
from appliance.apis.shape import ErrorShape, StreamSoFar, upstream_error
from appliance.engine import EngineView
from appliance.error_answer import error_answer, stream_error_end
from appliance.errors import ApiError, engine_lost, engine_unavailable, internal_error
from appliance.fences.uvicorn import ClientLink, client_link
from appliance.gate.gate import Gate
from appliance.metrics import RequestMetrics, arrived_at
from appliance.outbound import Outbound, PassThrough
from appliance.policy.cost_watch import CostWatch, Followed
from appliance.upstream import Reply, Upstream

PRIORITY_HEADER = "x-vllm-priority"  # vLLM's own; a client's is never forwarded

log = structlog.get_logger("appliance.relay")

_NO_CACHE = (b"cache-control", b"no-cache")


@dataclass(frozen=True)
class RelayDeps:
    """What every relay needs, built once per app."""

    engine: EngineView
    admission: Admission
    gate: Gate
    upstream: Upstream
    metrics: RequestMetrics
    cost: CostWatch


class Watch:
    """Cancels the owning task when the client disconnects, the engine is lost or the cost
    watch found the request too costly; says which.

    The client's connection tells through its ClientLink where the server gives one; under
    any other ASGI server a task waits in `receive()` for the disconnect."""

    def __init__(self, receive: Receive, engine: EngineView, link: ClientLink | None) -> None:
        self._receive = receive
        self._engine = engine
        self._link = link
        self.reason: str | None = None
        self._armed = False
        self._forget_client: Callable[[], object] = _nothing

    def __enter__(self) -> Watch:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._armed = True
        if self._link is not None:
            self._forget_client = self._link.on_gone(self._client_gone)
        else:
            self._forget_client = asyncio.ensure_future(self._listen()).cancel
        self._forget_engine = self._engine.on_lost(self._engine_lost)
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()
        self._forget_client()
        self._forget_engine()

    def disarm(self) -> None:
        """No cancellation from here on: the answer is complete or being completed."""
        self._armed = False

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._client_gone()

    def _client_gone(self) -> None:
        self._fire("client_disconnected")

    def _engine_lost(self) -> None:
        self._fire("engine_lost")

    def too_costly(self) -> None:
        self._fire("too_costly")

    def _fire(self, reason: str) -> None:
        if self._armed and self.reason is None:
            self.reason = reason
            self._task.cancel()


def _nothing() -> None:
    pass


class Relay:
    """The ASGI answer to one request for the worker (vetted, or passed through)."""

    def __init__(self, outbound: Outbound, deps: RelayDeps, request_id: str,
                 forward: dict[str, str]) -> None:
        self._outbound = outbound
        self._deps = deps
        self._request_id = request_id
        self._forward = forward  # request headers passed on to the worker
        self._shape: ErrorShape = outbound.shape
        self._so_far = StreamSoFar(outbound.payload)  # what a stream's ending must know
        self._started = False  # the head has gone to the client
        self._sending = False  # a chunk is on its way through ASGI: none may pass it
        self._first_at: float | None = None  # the request's arrival, until the first chunk
        self._cost: Followed  # from the moment it is at the engine (the cost watch follows it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deps = self._deps
        self._route = str(scope.get("path_template") or scope["path"])
        self._link = client_link(scope)
        self._arrived = arrived_at(scope)
        watch = Watch(receive, deps.engine, self._link)
        outbound = self._outbound
        try:
            with watch:
                async with outbound.slot(deps.admission) as meter:
                    # Counted as work the worker owes until its answer is all read, so that
                    # the supervisor sees it even when the worker's own gauges froze.
                    waiting = deps.engine.waiting
                    waiting.add(self, self._request_id, outbound)
                    try:
                        await outbound.fit_budget(deps.gate)
                        with deps.cost.follow(outbound.payload, watch.too_costly,
                                              engine_work=not isinstance(outbound, PassThrough)
                                              ) as self._cost:
                            last = await self._exchange(send, watch, meter)
                    finally:
                        waiting.discard(self)
                # The slot is given back and the usage charged before the client can see the
                # end: its next request never finds this one still holding them.
                await send(last)
        except asyncio.CancelledError:
            if watch.reason is None or (task := asyncio.current_task()) is None:
                raise
            task.uncancel()
            await self._interrupted(send, watch.reason)
        except ApiError as error:
            await self._fail(send, error)
        except Exception as exc:  # a bug of ours: one log line with the traceback, a 500
            await self._fail(send, internal_error(exc))

    async def _exchange(self, send: Send, watch: Watch, meter: Meter) -> Message:
        """Relays the answer but its last message, which it returns."""
        outbound, deps = self._outbound, self._deps
        body = outbound.body()
        headers = {"x-request-id": self._request_id, **self._forward}
        if body is not None:
            headers["content-type"] = "application/json"
        if outbound.priority is not None:  # vLLM reads it on every generation route
            headers[PRIORITY_HEADER] = str(outbound.priority)
        meter.sending(outbound.prompt_tokens)  # from here the engine's work is charged
        async with deps.upstream.exchange(outbound.method, outbound.target, body, headers) as reply:
            if reply.status >= 300:
                meter.refused()
                error = upstream_error(reply.status, await reply.read())
                raise outbound.refine(error) if outbound.refine is not None else error
            if outbound.stream:
                return await self._stream(send, reply, watch, meter)
            body = await reply.read()
            meter.read_body(body)
            await self._head(send, reply)
            watch.disarm()
            return {"type": "http.response.body", "body": body, "more_body": False}

    async def _stream(self, send: Send, reply: Reply, watch: Watch, meter: Meter) -> Message:
        self._first_at = self._arrived  # time to first token counts the queue and the prefill
        await self._head(send, reply)
        if self._link is not None and not meter.enabled:
            # Each event straight from the worker's connection to the client's while the
            # client keeps up; what it cannot take yet comes through the loop below.
            reply.forward(self._write_direct)
        held = b""  # once the whole answer is here, the last of it goes out with the end
        async for chunk in meter.tap(reply.chunks(), strip=self._outbound.usage_added):
            self._relayed(chunk)
            if held:
                await self._send_chunk(send, held)
                held = b""
            if reply.complete:  # nothing is left to wait for: one write, not two
                watch.disarm()  # the engine owes nothing more; what is here is delivered
                held = chunk
                continue
            await self._send_chunk(send, chunk)
        watch.disarm()
        return {"type": "http.response.body", "body": held, "more_body": False}

    async def _send_chunk(self, send: Send, chunk: bytes) -> None:
        self._sending = True
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self._sending = False

    def _write_direct(self, chunk: bytes) -> bool:
        assert self._link is not None
        if self._sending or not self._link.write(chunk):
            return False
        self._relayed(chunk)
        return True

    def _relayed(self, chunk: bytes) -> None:
        if self._first_at is not None:
            self._deps.metrics.first_token(self._route, time.perf_counter() - self._first_at)
            self._first_at = None
        self._so_far.relayed(chunk)
        self._cost.progressed(chunk.count(b"data:"))

    async def _head(self, send: Send, reply: Reply) -> None:
        headers = reply.headers + _encode_headers(self._outbound.headers)
        if self._outbound.stream:
            headers.append(_NO_CACHE)
        headers.append((b"x-request-id", self._request_id.encode("latin-1")))
        self._started = True
        await send({"type": "http.response.start", "status": reply.status, "headers": headers})

    async def _interrupted(self, send: Send, reason: str) -> None:
        if reason == "client_disconnected":
            self._deps.metrics.disconnected(self._outbound.stream)
            log.info("request.client_disconnected", stream=self._outbound.stream)
            return  # nobody is listening; leaving the exchange closed the upstream
        if reason == "too_costly" and self._cost.verdict is not None:
            await self._fail(send, self._cost.verdict.logged())
            return
        retry_after_s = self._deps.engine.retry_after_s()
        # Before the head the client got nothing: the engine was unavailable to it.
        await self._fail(send, engine_lost(retry_after_s) if self._started
                         else engine_unavailable("restarting", retry_after_s))

    async def _fail(self, send: Send, error: ApiError) -> None:
        """The error as the answer, or as the stream's last event if the head already went."""
        metrics = self._deps.metrics
        try:
            if self._started:
                end = stream_error_end(error, self._shape, self._so_far, metrics, route=self._route)
                await send({"type": "http.response.body", "body": end, "more_body": False})
                return
            await error_answer(error, self._shape, self._request_id, metrics,
                               route=self._route).send(send)
        except OSError:
            log.info("request.client_gone_before_error")  # nothing left to tell anyone


def _encode_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

