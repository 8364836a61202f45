"""The steps a request takes on an engine fault: ask the supervisor whether the worker is lost,
wait out the restart, and come back isolated where it is a suspect (appliance.recovery holds the
rules; the owner, appliance.proxy.relay, then sends it again or its continuation)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import structlog

from appliance.answers.shape import upstream_error
from appliance.core.errors import ApiError
from appliance.core.upstream import Upstream
from appliance.proxy.held import Held
from appliance.proxy.pump import Isolation
from appliance.recovery.replay import Fate, engine_back, engine_fault, request_failed, worker_fate

log = structlog.get_logger("appliance.proxy.relay")  # the request's events keep one logger


def suspects(held: Held, error: ApiError) -> bool:
    """Whether this failure may be the engine's (the supervisor is asked: `confirm`)."""
    return held.watch.reason is None and engine_fault(error)


async def diagnosed(held: Held, serial: int) -> ApiError:
    """Why a worker that still serves dropped the request: its own refusal where the route
    can ask for it (Outbound.diagnosis), else a failure with no reason given."""
    outbound, deps = held.ticket.outbound, held.deps
    asked = outbound.diagnosis()
    if asked is None or deps.engine.serial != serial:
        return request_failed()
    status, content = await ask_worker(deps.upstream, outbound.target, asked)
    return upstream_error(status, content) if 400 <= status < 500 else request_failed()


async def ask_worker(upstream: Upstream, path: str, payload: dict[str, Any]) -> tuple[int, bytes]:
    """What a stream's record asks of the worker now serving to prepare its continuation."""
    return await upstream.fetch("POST", path, msgspec.json.encode(payload))


async def confirm(held: Held, error: ApiError, serial: int) -> None:
    """Returns once the supervisor declared the worker lost. Raises the request's own
    failure where the worker still serves, `error` where neither is known in time."""
    engine, resume, key = held.deps.engine, held.deps.resume, held.ticket
    engine.waiting.checking(key)  # not work the engine owes while the supervisor is asked
    fate = await worker_fate(engine, serial, min(resume.confirm_s, resume.max_wait_s))
    if fate is Fate.SERVING:
        engine.waiting.discard(key)  # nor a victim of a later death
        log.info("request.failed_on_serving_engine", error=error.code, worker=serial)
        raise await diagnosed(held, serial)
    if fate is Fate.UNKNOWN:
        engine.waiting.checked(key)
        raise error


async def outlive(held: Held, error: ApiError, serial: int, how: str) -> None:
    """Waits out the engine fault `error` told of, until a new worker serves. Raises `error`
    where the request cannot go on: the client has part of a stream that cannot be
    continued, or no new worker serves in time."""
    deps, ticket, pump = held.deps, held.ticket, held.pump
    engine, record = deps.engine, pump.record
    # Its name as the forensics gave it at the death (its body as sent, or as it stands if
    # it failed before it was: at its budget's count).
    fingerprint = engine.waiting.fingerprint(ticket, ticket.outbound.body())
    deadline = time.monotonic() + deps.resume.max_wait_s
    await confirm(held, error, serial)
    # In flight at the death (the supervisor has read it); no work of the next worker yet,
    # nor in flight at its death if it dies booting.
    engine.waiting.set_aside(ticket)
    if not deps.resume.enabled or (pump.relayed_any and (record is None or not record.resumable)):
        raise error
    log.info("request.engine_fault", error=error.code, worker=serial, how=how)
    if not await engine_back(engine, serial, deadline - time.monotonic()):
        raise error
    # The death is counted by now: one that was its last allowed is refused, not sent.
    deps.quarantine.check(fingerprint)
    await isolate(held, fingerprint)  # set aside while it waits: not in flight meanwhile
    held.watch.follow_engine()
    engine.waiting.add(ticket, ticket.request_id, ticket.outbound)
    deps.metrics.outlived.labels(route=ticket.route, how=how).inc()
    log.info("request.outlived_engine_fault", how=how, worker=engine.serial)


async def isolate(held: Held, fingerprint: str) -> None:
    """A request in flight at a death is sent again with no other such request beside it
    until its answer begins, or resume.isolation_s at most (Quarantine.isolation)."""
    quarantine, window_s, pump = held.deps.quarantine, held.deps.resume.isolation_s, held.pump
    if ((pump.isolation is not None and pump.isolation.held) or window_s == 0
            or not quarantine.suspected(fingerprint)):
        return
    await quarantine.isolation.acquire()
    isolation = pump.isolation = Isolation(quarantine.isolation)
    held.stack.callback(isolation.leave)
    timer = asyncio.get_running_loop().call_later(window_s, isolation.leave)
    held.stack.callback(timer.cancel)
