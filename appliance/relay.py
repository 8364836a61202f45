"""One generation request from admission to its last byte, as the ASGI app its handler returns.

The Relay is the single owner of everything a request holds: its admission slot, its upstream
exchange and its watch (client gone, engine lost), all released by leaving one `async with`.
It answers every outcome itself, in the route's error shape: before the head a plain error
answer, after it the protocol's own stream ending, so no request is left without an end.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
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
from appliance.policy.cost_watch import CostWatch, Followed, tokens_per_event
from appliance.recovery.quarantine import Quarantine
from appliance.recovery.replay import (
    Fate,
    engine_back,
    engine_died,
    engine_fault,
    request_failed,
    worker_fate,
)
from appliance.recovery.stream import KEPT_BYTES, Continuation
from appliance.settings import ResumeSettings
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
    resume: ResumeSettings
    quarantine: Quarantine
    cost: CostWatch


class Watch:
    """Cancels the owning task when the client disconnects, the engine is lost or the cost
    watch found the request too costly; says which.

    The client's connection tells through its ClientLink where the server gives one; under
    any other ASGI server a task waits in `receive()` for the disconnect."""

    def __init__(self, receive: Receive, engine: EngineView, link: ClientLink | None,
                 on_engine_lost: Callable[[], None] | None = None) -> None:
        self._receive = receive
        self._engine = engine
        self._link = link
        # Where the request may outlive the engine, its loss breaks the exchange instead: the
        # relay hears it where it reads the worker, and sends the request on to the next one.
        self._on_engine_lost = on_engine_lost
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
        self._on_engine_lost = None  # it calls back into the relay that holds this watch

    def disarm(self) -> None:
        """No cancellation from here on: the answer is complete or being completed."""
        self._armed = False

    def follow_engine(self) -> None:
        """Watch the worker now serving (a loss is told once per worker)."""
        self._forget_engine()
        self._forget_engine = self._engine.on_lost(self._engine_lost)

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._client_gone()

    def _client_gone(self) -> None:
        self._fire("client_disconnected")

    def _engine_lost(self) -> None:
        if self._on_engine_lost is not None and self._armed:
            self._on_engine_lost()
            return
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
        # The event the worker's stream ends with when its engine died (read in each read that
        # does not end cleanly); None where it writes none.
        self._death = outbound.death
        self._refusal = outbound.refusal  # where the worker's refusal loses its reason
        # How a read of its stream ends when it cannot hold that error (a token event): such a
        # read is not searched (an empty end: every read is).
        self._clean = outbound.clean_end or b""
        self._clean_size = len(self._clean)
        self._last = self._before_last = b""  # the last two chunks relayed (StreamSoFar)
        self._record = outbound.record if deps.resume.enabled else None  # to resume a stream
        self._started = False  # the head has gone to the client
        self._relayed_any = False  # and some of the body: the request can no longer start over
        self._answering = False  # a byte of the answer came in this exchange (Waiting.answering)
        self._sending = False  # a chunk is on its way through ASGI: none may pass it
        self._first_at: float | None = None  # the request's arrival, until the first chunk
        self._reply: Reply | None = None  # the worker's answer being read
        # What the answer holds until it ends, released last first: its exchanges with the
        # worker (one per worker it was sent to), its isolation as a suspect.
        self._exits: list[Callable[[], object]] = []
        self._original: Continuation | None = None  # the request as first sent
        self._isolated: asyncio.Lock | None = None  # held while sent again as a suspect
        self._cost: Followed  # from the moment it is at the engine (the cost watch follows it)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deps = self._deps
        self._route = str(scope.get("path_template") or scope["path"])
        self._link = client_link(scope)
        self._arrived = arrived_at(scope)
        self._watch = watch = Watch(receive, deps.engine, self._link,
                                    self._break if deps.resume.enabled else None)
        outbound = self._outbound
        try:
            with watch:
                async with outbound.slot(deps.admission) as meter:
                    try:
                        with deps.cost.follow(outbound.constraint, watch.too_costly,
                                              engine_work=not isinstance(outbound, PassThrough),
                                              streamed=outbound.stream,
                                              per_event=tokens_per_event(outbound.payload)
                                              ) as self._cost:
                            last = await self._answer(send, watch, meter)
                    finally:
                        self._release()
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
        finally:
            # The reply's sink calls back into the relay: no cycle is left for the collector.
            self._reply = None

    async def _answer(self, send: Send, watch: Watch, meter: Meter) -> Message:
        """The exchange, sent again to the next worker after each engine fault it can outlive
        before its head reached the client (a stream's later faults: see _from_worker)."""
        outbound, deps = self._outbound, self._deps
        waiting = deps.engine.waiting
        request: Continuation | None = None
        # Counted as work the worker owes until its answer is all read, so that the supervisor
        # sees it even when the worker's own gauges froze (set aside while no worker has it).
        with waiting.holding(self, self._request_id, outbound):
            while True:
                serial = deps.engine.serial
                try:
                    if request is None:
                        await outbound.fit_budget(deps.gate)
                        request = self._original = Continuation(outbound.target, outbound.body())
                    return await self._exchange(send, watch, meter, request, serial)
                except ApiError as error:
                    if self._started or not self._suspects(error):
                        raise
                    await self._recover(error, serial, "replayed")  # then the same again

    async def _exchange(self, send: Send, watch: Watch, meter: Meter, request: Continuation,
                        serial: int) -> Message:
        """Relays the answer but its last message, which it returns."""
        outbound = self._outbound
        reply = await self._send(request, meter)
        if outbound.stream:
            return await self._stream(send, reply, watch, meter, serial)
        body = await reply.read()
        meter.read_body(body)
        await self._head(send, reply)
        watch.disarm()
        return {"type": "http.response.body", "body": body, "more_body": False}

    async def _send(self, request: Continuation, meter: Meter) -> Reply:
        """The request to the worker, its exchange open until the answer ends; its head."""
        outbound = self._outbound
        headers = {"x-request-id": self._request_id, **self._forward}
        if request.body is not None:
            headers["content-type"] = "application/json"
        if outbound.priority is not None:  # vLLM reads it on every generation route
            headers[PRIORITY_HEADER] = str(outbound.priority)
        # Never sent again once in flight at resume.quarantine_after engine deaths: one input
        # that crashes the engine must not crash it each time it is retried.
        deps, waiting = self._deps, self._deps.engine.waiting
        waiting.name(self, request.body)
        if deps.quarantine.suspecting:
            deps.quarantine.check(waiting.fingerprint(self, request.body))
        meter.sending(outbound.prompt_tokens)  # from here the engine's work is charged
        self._reply = reply = await deps.upstream.open(outbound.method, request.target,
                                                       request.body, headers)
        self._exits.append(reply.close)
        self._answering = False
        if reply.status >= 300:
            error = upstream_error(reply.status, await reply.read())
            if engine_fault(error):
                raise error
            meter.refused()
            raise outbound.refine(error) if outbound.refine is not None else error
        return reply

    async def _stream(self, send: Send, reply: Reply, watch: Watch, meter: Meter,
                      serial: int) -> Message:
        self._first_at = self._arrived  # time to first token counts the queue and the prefill
        self._reply = reply
        await self._head(send, reply)
        self._direct(reply, meter)
        held = b""  # once the whole answer is here, the last of it goes out with the end
        source = self._from_worker(reply, serial, meter)
        async for chunk in meter.tap(source, strip=self._outbound.usage_added):
            if not chunk:
                continue
            self._relayed(chunk)
            if held:
                await self._send_chunk(send, held)
                held = b""
            if self._reply is None or self._reply.complete:  # nothing is left to wait for
                watch.disarm()  # the engine owes nothing more; what is here is delivered
                held = chunk
                continue
            await self._send_chunk(send, chunk)
        watch.disarm()
        return {"type": "http.response.body", "body": held, "more_body": False}

    def _direct(self, reply: Reply, meter: Meter) -> None:
        if self._link is not None and not meter.enabled:
            # Each event straight from the worker's connection to the client's while the
            # client keeps up; what it cannot take yet comes through the loop in _stream.
            reply.forward(self._write_direct)

    async def _from_worker(self, reply: Reply, serial: int, meter: Meter) -> AsyncIterator[bytes]:
        """The stream's bytes from the worker as the client gets them, across engine faults:
        after each, the rest comes from the next worker (the request again if the client has
        had nothing of it, else its continuation); an end when the stream already had its
        last token."""
        while True:
            try:
                async for chunk in reply.chunks():
                    if self._death is not None and self._death.told(chunk):
                        raise engine_died()  # a hint: _recover asks the supervisor
                    if self._refusal is not None and self._refusal.told(chunk):
                        raise await self._diagnosed(serial)
                    yield self._record.take(chunk) if self._record is not None else chunk
                return
            except ApiError as error:
                if not self._suspects(error):
                    raise
                if self._record is not None and self._relayed_any and self._record.finished:
                    yield self._record.tail()
                    self._reply = None
                    return
                resumed = self._relayed_any
                await self._recover(error, serial, "resumed" if resumed else "replayed")
                assert self._original is not None
                request = self._original
                if resumed and self._record is not None:
                    await self._record.prepare(self._ask_worker)
                    request = self._record.continuation()
            serial = self._deps.engine.serial
            reply = await self._send(request, meter)
            self._direct(reply, meter)

    async def _diagnosed(self, serial: int) -> ApiError:
        """Why a worker that still serves dropped the request: its own refusal where the route
        can ask for it (Outbound.diagnosis), else a failure with no reason given."""
        asked = self._outbound.diagnosis()
        if asked is None or self._deps.engine.serial != serial:
            return request_failed()
        status, content = await self._ask_worker(self._outbound.target, asked)
        return upstream_error(status, content) if 400 <= status < 500 else request_failed()

    async def _ask_worker(self, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
        """What a record asks of the worker now serving to prepare its continuation."""
        return await self._deps.upstream.fetch("POST", path, msgspec.json.encode(payload))

    def _suspects(self, error: ApiError) -> bool:
        """Whether this failure may be the engine's (the supervisor is asked: _confirm)."""
        return self._watch.reason is None and engine_fault(error)

    async def _confirm(self, error: ApiError, serial: int) -> None:
        """Returns once the supervisor declared the worker lost. Raises the request's own
        failure where the worker still serves, `error` where neither is known in time."""
        engine = self._deps.engine
        engine.waiting.checking(self)  # not work the engine owes while the supervisor is asked
        resume = self._deps.resume
        fate = await worker_fate(engine, serial, min(resume.confirm_s, resume.max_wait_s))
        if fate is Fate.SERVING:
            engine.waiting.discard(self)  # nor a victim of a later death
            log.info("request.failed_on_serving_engine", error=error.code, worker=serial)
            raise await self._diagnosed(serial)
        if fate is Fate.UNKNOWN:
            engine.waiting.checked(self)
            raise error

    async def _recover(self, error: ApiError, serial: int, how: str) -> None:
        """Waits out the engine fault `error` told of, until a new worker serves. Raises `error`
        where the request cannot go on: the client has part of a stream that cannot be
        continued, or no new worker serves in time."""
        deps, record, engine = self._deps, self._record, self._deps.engine
        # Its name as the forensics gave it at the death (its body as sent, or as it stands if
        # it failed before it was: at its budget's count).
        fingerprint = engine.waiting.fingerprint(self, self._outbound.body())
        deadline = time.monotonic() + deps.resume.max_wait_s
        await self._confirm(error, serial)
        # In flight at the death (the supervisor has read it); no work of the next worker yet,
        # nor in flight at its death if it dies booting.
        engine.waiting.set_aside(self)
        if not deps.resume.enabled or (self._relayed_any
                                       and (record is None or not record.resumable)):
            raise error
        log.info("request.engine_fault", error=error.code, worker=serial, how=how)
        if not await engine_back(engine, serial, deadline - time.monotonic()):
            raise error
        # The death is counted by now: one that was its last allowed is refused, not sent.
        deps.quarantine.check(fingerprint)
        await self._isolate(fingerprint)  # set aside while it waits: not in flight meanwhile
        self._watch.follow_engine()
        engine.waiting.add(self, self._request_id, self._outbound)
        deps.metrics.outlived.labels(route=self._route, how=how).inc()
        log.info("request.outlived_engine_fault", how=how, worker=engine.serial)

    async def _isolate(self, fingerprint: str) -> None:
        """A request in flight at a death is sent again with no other such request beside it
        until its answer begins, or resume.isolation_s at most (Quarantine.isolation)."""
        quarantine, window_s = self._deps.quarantine, self._deps.resume.isolation_s
        if self._isolated is not None or window_s == 0 or not quarantine.suspected(fingerprint):
            return
        lock = quarantine.isolation
        await lock.acquire()
        self._isolated = lock
        timer = asyncio.get_running_loop().call_later(window_s, self._leave_isolation)
        self._exits += (self._leave_isolation, timer.cancel)

    def _release(self) -> None:
        """Everything the answer held, last taken first (each runs whatever the others do)."""
        exits, self._exits = self._exits, []
        error: BaseException | None = None
        for release in reversed(exits):
            try:
                release()
            except Exception as exc:  # a bug: the rest are still released, then it is raised
                error = error or exc
        if error is not None:
            raise error

    def _leave_isolation(self) -> None:
        if self._isolated is not None:
            self._isolated.release()
            self._isolated = None

    def _break(self) -> None:
        """The engine was declared lost: the exchange under way fails where it is read."""
        if self._reply is not None:
            self._reply.abort()

    async def _send_chunk(self, send: Send, chunk: bytes) -> None:
        self._sending = True
        try:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        finally:
            self._sending = False

    def _write_direct(self, chunk: bytes) -> bool:
        """One read of the worker, straight to the client's connection; False: the loop in
        _stream takes it (the client is not keeping up, an ASGI send is under way, or the
        engine died: that is the loop's to handle). A stream's every event comes here. A read
        that ends with a token event (the API's clean end) holds no error event of a death: of
        a steady stream, it costs the write, an append to its record's `kept` and what
        `_relayed` does for a steady stream's event, inline, with no search and no call."""
        if self._sending:
            return False
        record = self._record
        if (not self._clean_size or chunk[-self._clean_size:] != self._clean
                or (record is not None and not record.verbatim)):
            return self._write_searched(chunk)
        link = self._link
        assert link is not None
        if not link.write(chunk):
            return False
        if record is not None:  # kept as it came (Record.kept: no call per event)
            record.kept.append(chunk)
            record.kept_bytes += len(chunk)
            if record.kept_bytes > KEPT_BYTES:
                record.read_kept()
        if self._answering:  # what _relayed does for a steady stream's event, with no call
            self._before_last, self._last = self._last, chunk
            cost = self._cost
            if cost.measuring:
                cost.progressed(chunk)
        else:
            self._relayed(chunk)
        return True

    def _write_searched(self, chunk: bytes) -> bool:
        """_write_direct's read that may hold a death's error event, or that the record reads."""
        if (self._death is not None and self._death.told(chunk)) or (
                self._refusal is not None and self._refusal.told(chunk)):
            return False
        record, link = self._record, self._link
        assert link is not None
        if record is None:
            if not link.write(chunk):
                return False
        else:
            if not link.writable():  # asked before the record takes the chunk: it takes it once
                return False
            chunk = record.take(chunk)
            if not chunk:
                return True
            link.write(chunk)
        self._relayed(chunk)
        return True

    def _relayed(self, chunk: bytes) -> None:
        """Each chunk on its way to the client (for a stream from a real worker: each token)."""
        if not self._answering:
            self._answer_began()
        self._before_last, self._last = self._last, chunk  # what a stream's error end reads
        if self._cost.measuring:  # most streams' tokens are not timed (CostWatch.timed)
            self._cost.progressed(chunk)

    def _answer_began(self) -> None:
        """The first chunk of an exchange: the worker took the request up."""
        if self._first_at is not None:
            self._deps.metrics.first_token(self._route, time.perf_counter() - self._first_at)
            self._first_at = None
        self._relayed_any = True
        self._answering = True  # it owes no first token
        self._deps.engine.waiting.answering(self)
        if self._isolated is not None:  # its answer began: the next suspect may go
            self._leave_isolation()

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
                so_far = StreamSoFar(self._outbound.payload, self._last, self._before_last)
                end = stream_error_end(error, self._shape, so_far, metrics, route=self._route)
                await send({"type": "http.response.body", "body": end, "more_body": False})
                return
            await error_answer(error, self._shape, self._request_id, metrics,
                               route=self._route).send(send)
        except OSError:
            log.info("request.client_gone_before_error")  # nothing left to tell anyway


def _encode_headers(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]

