"""One generation request from admission to its last byte, as the ASGI app its handler returns.

`Relay.__call__` owns the request: whatever it holds (its watch, its admission slot, the cost
watch's follow, its place in the ledger of work the worker owes, each exchange with a worker,
its isolation as a suspect) is entered into one exit stack and released by leaving it. In
between it calls its steps in order: fit the budget, send (`_send`), pump the answer
(appliance.proxy.pump), and on an engine fault outlive it (appliance.proxy.recover) and send
again. It answers every outcome itself, in the route's error shape: before the head a plain
error answer, after it the protocol's own stream ending, so no request is left without an end.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack

import structlog
from litestar.types import Message, Receive, Scope, Send

from appliance.answers.answer import error_answer, stream_error_end
from appliance.answers.shape import StreamSoFar, upstream_error
from appliance.core.errors import ApiError, engine_lost, engine_unavailable, internal_error
from appliance.core.upstream import Reply
from appliance.fences.uvicorn import client_link
from appliance.gate.gate import Vetted
from appliance.observe.metrics import arrived_at
from appliance.policy.cost_watch import tokens_per_event
from appliance.proxy.held import Held
from appliance.proxy.outbound import Outbound, PassThrough
from appliance.proxy.pump import Pump
from appliance.proxy.recover import ask_worker, diagnosed, outlive, suspects
from appliance.proxy.request import RelayDeps, Ticket
from appliance.proxy.watch import Watch
from appliance.recovery.replay import engine_died, engine_fault
from appliance.recovery.stream import Continuation

__all__ = ["PRIORITY_HEADER", "Relay", "RelayDeps"]

PRIORITY_HEADER = "x-vllm-priority"  # vLLM's own; a client's is never forwarded

log = structlog.get_logger("appliance.proxy.relay")


class Relay:
    """The ASGI answer to one request for the worker (vetted, or passed through)."""

    def __init__(self, outbound: Outbound, deps: RelayDeps, request_id: str,
                 forward: dict[str, str]) -> None:
        self._outbound = outbound
        self._deps = deps
        self._request_id = request_id
        self._forward = forward  # request headers passed on to the worker

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deps, outbound = self._deps, self._outbound
        ticket = Ticket(outbound, self._request_id,
                        str(scope.get("path_template") or scope["path"]), self._forward)
        link = client_link(scope)
        watch = Watch(receive, deps.engine, link, breaks_exchange=deps.resume.enabled)
        pump = Pump(ticket, deps, link, arrived_at(scope))
        try:
            async with AsyncExitStack() as stack:
                stack.enter_context(watch)
                meter = await stack.enter_async_context(outbound.slot(deps.admission))
                pump.cost = stack.enter_context(deps.cost.follow(
                    outbound.constraint, watch.too_costly,
                    engine_work=not isinstance(outbound, PassThrough), streamed=outbound.stream,
                    per_event=tokens_per_event(outbound.payload)))
                # Counted as work the worker owes until its answer is all read, so that the
                # supervisor sees it even when the worker's own gauges froze (set aside while
                # no worker has it).
                stack.enter_context(deps.engine.waiting.holding(ticket, ticket.request_id,
                                                                outbound))
                last = await _answer(send, Held(ticket, deps, watch, pump, meter, stack))
            # The slot is given back and the usage charged before the client can see the end:
            # its next request never finds this one still holding them.
            await send(last)
        except asyncio.CancelledError:
            if watch.reason is None or (task := asyncio.current_task()) is None:
                raise
            task.uncancel()
            await _interrupted(send, ticket, deps, pump, watch.reason)
        except ApiError as error:
            await _fail(send, ticket, deps, pump, error)
        except Exception as exc:  # a bug of ours: one log line with the traceback, a 500
            await _fail(send, ticket, deps, pump, internal_error(exc))


async def _answer(send: Send, held: Held) -> Message:
    """The answer but its last message, which it returns; the request sent again to the next
    worker after each engine fault it can outlive before its head reached the client (a
    stream's later faults: `_from_worker`)."""
    outbound, deps = held.ticket.outbound, held.deps
    request: Continuation | None = None
    while True:
        serial = deps.engine.serial
        try:
            if request is None:
                if isinstance(outbound, Vetted):  # a pass-through has no budget
                    await deps.gate.fit_budget(outbound)
                request = Continuation(outbound.target, outbound.body())
            reply = await _send(held, request)
            if outbound.stream:
                source = _from_worker(held, reply, serial, request)
                return await held.pump.stream(send, reply, source, held.watch, held.meter)
            body = await reply.read()
            held.meter.read_body(body)
            await held.pump.head(send, reply)
            held.watch.disarm()
            return {"type": "http.response.body", "body": body, "more_body": False}
        except ApiError as error:
            if held.pump.started or not suspects(held, error):
                raise
            await outlive(held, error, serial, "replayed")  # then the same again


async def _send(held: Held, request: Continuation) -> Reply:
    """The request to the worker, its exchange open until the request's end; its head."""
    ticket, deps, meter = held.ticket, held.deps, held.meter
    outbound, waiting = ticket.outbound, deps.engine.waiting
    headers = {"x-request-id": ticket.request_id, **ticket.forward}
    if request.body is not None:
        headers["content-type"] = "application/json"
    if outbound.priority is not None:  # vLLM reads it on every generation route
        headers[PRIORITY_HEADER] = str(outbound.priority)
    # Never sent again once in flight at resume.quarantine_after engine deaths: one input
    # that crashes the engine must not crash it each time it is retried.
    waiting.name(ticket, request.body)
    if deps.quarantine.suspecting:
        deps.quarantine.check(waiting.fingerprint(ticket, request.body))
    meter.sending(outbound.prompt_tokens)  # from here the engine's work is charged
    reply = await deps.upstream.open(outbound.method, request.target, request.body, headers)
    held.stack.callback(reply.close)
    held.watch.exchange = reply
    held.pump.answering = False
    if reply.status >= 300:
        error = upstream_error(reply.status, await reply.read())
        if engine_fault(error):
            raise error
        meter.refused()
        raise outbound.refine(error) if outbound.refine is not None else error
    return reply


async def _from_worker(held: Held, reply: Reply, serial: int,
                       original: Continuation) -> AsyncIterator[bytes]:
    """The stream's bytes from the worker as the client gets them, across engine faults:
    after each, the rest comes from the next worker (the request again if the client has
    had nothing of it, else its continuation); an end when the stream already had its
    last token."""
    outbound, pump = held.ticket.outbound, held.pump
    death, refusal, record = outbound.death, outbound.refusal, pump.record
    while True:
        try:
            async for chunk in reply.chunks():
                if death is not None and death.told(chunk):
                    raise engine_died()  # a hint: outlive asks the supervisor
                if refusal is not None and refusal.told(chunk):
                    raise await diagnosed(held, serial)
                yield record.take(chunk) if record is not None else chunk
            return
        except ApiError as error:
            if not suspects(held, error):
                raise
            if record is not None and pump.relayed_any and record.finished:
                yield record.tail()
                held.watch.exchange = None
                return
            resumed = pump.relayed_any
            await outlive(held, error, serial, "resumed" if resumed else "replayed")
            request = original
            if resumed and record is not None:
                await record.prepare(functools.partial(ask_worker, held.deps.upstream))
                request = record.continuation()
        serial = held.deps.engine.serial
        reply = await _send(held, request)
        pump.forward(reply, held.meter)


async def _interrupted(send: Send, ticket: Ticket, deps: RelayDeps, pump: Pump,
                       reason: str) -> None:
    """The answer to a request its watch stopped: the client went, it cost too much, or the
    engine was lost where it could not be outlived."""
    stream = ticket.outbound.stream
    if reason == "client_disconnected":
        deps.metrics.disconnected(stream)
        log.info("request.client_disconnected", stream=stream)
        return  # nobody is listening; leaving the exchange closed the upstream
    if reason == "too_costly" and pump.cost.verdict is not None:
        await _fail(send, ticket, deps, pump, pump.cost.verdict.logged())
        return
    retry_after_s = deps.engine.retry_after_s()
    # Before the head the client got nothing: the engine was unavailable to it.
    await _fail(send, ticket, deps, pump, engine_lost(retry_after_s) if pump.started
                else engine_unavailable("restarting", retry_after_s))


async def _fail(send: Send, ticket: Ticket, deps: RelayDeps, pump: Pump, error: ApiError) -> None:
    """The error as the answer, or as the stream's last event if the head already went."""
    metrics, outbound = deps.metrics, ticket.outbound
    try:
        if pump.started:
            so_far = StreamSoFar(outbound.payload, *pump.so_far)
            end = stream_error_end(error, outbound.shape, so_far, metrics, route=ticket.route)
            await send({"type": "http.response.body", "body": end, "more_body": False})
            return
        await error_answer(error, outbound.shape, ticket.request_id, metrics,
                           route=ticket.route).send(send)
    except OSError:
        log.info("request.client_gone_before_error")  # nothing left to tell anyway
