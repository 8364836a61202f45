"""When a request whose exchange with the worker failed may be sent again, and to whom.

An engine fault is the supervisor's fact, never a guess from bytes. A failed exchange (a cut
connection, a 5xx, vLLM's own death event in its exact place and shape) is only a hint, and the
relay asks what became of the worker (`worker_fate`): the supervisor declared it lost (its
process exited, its probes failed, a hang verdict from the engine's own progress), or it still
serves and answers its health probe, so the failure was the request's own (a client's text, a
request vLLM dropped); or neither within `resume.confirm_s`. While it asks, the request is not
work the engine owes (appliance.core.engine.Waiting.checking). After a loss the new worker's start is
waited for up to `resume.max_wait_s` in all.
"""

from __future__ import annotations

import asyncio
import enum

import structlog

from appliance.core.engine import EngineState, EngineView
from appliance.core.errors import ApiError, EngineUnavailable, UpstreamError
from appliance.fences.vllm import ENGINE_DEAD_MESSAGE

log = structlog.get_logger("appliance.recovery")

_HOPELESS = (EngineState.FAILED, EngineState.STOPPED)  # no worker comes back by itself
# How often a worker that has not been declared lost is asked whether it serves, while a
# failed exchange waits on it (the supervisor's own probes run at their own pace).
PROBE_EVERY_S = 1.0


class Fate(enum.Enum):
    """What became of the worker a request's exchange failed on."""

    LOST = "lost"  # the supervisor declared it lost: the request may go to the next worker
    SERVING = "serving"  # it answers its health probe: the failure was the request's own
    UNKNOWN = "unknown"  # neither in time, or the supervisor is stopping


def engine_died() -> UpstreamError:
    """What the worker said in its stream (its own error event): its engine core died."""
    return UpstreamError(500, ENGINE_DEAD_MESSAGE, param=None, code="engine_error")


def request_failed() -> UpstreamError:
    """A failed exchange on a worker that still serves: the engine gave no reason."""
    return UpstreamError(502, "the engine ended this request without an answer while it went on "
                         "serving others; the request itself is the likely cause",
                         param=None, code="request_failed")


def engine_fault(error: ApiError) -> bool:
    """Whether the failure may be the engine's: the worker stopped answering (its connection
    broke or failed), or it answered that its engine core died (vLLM's API server says so with
    a 500 and then exits). A hint only: worker_fate says what it was."""
    if isinstance(error, EngineUnavailable):
        return True
    return isinstance(error, UpstreamError) and error.status == 500 \
        and error.message.startswith(ENGINE_DEAD_MESSAGE)


async def worker_fate(engine: EngineView, serial: int, max_wait_s: float) -> Fate:
    """Whether the worker numbered `serial` was declared lost (it stops being the one that
    serves; the supervisor has then read which requests were in flight), or still serves."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    while engine.serial == serial and engine.state is EngineState.READY:
        if engine.stop_requested or loop.time() >= deadline:
            return Fate.UNKNOWN
        if await engine.answers(serial):
            return Fate.SERVING
        await engine.changed(min(PROBE_EVERY_S, deadline - loop.time()))
    return Fate.LOST


async def engine_back(engine: EngineView, failed: int, max_wait_s: float) -> bool:
    """Whether a worker newer than `failed` (a serial) serves within `max_wait_s`; False at
    once when the supervisor is stopping or has given up (a crash loop, a fault that needs an
    operator)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    while not (engine.serial > failed and engine.state is EngineState.READY):
        if engine.stop_requested or engine.state in _HOPELESS or loop.time() >= deadline:
            return False
        await engine.changed(deadline - loop.time())
    return True
