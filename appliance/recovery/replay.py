"""When a request whose exchange with the worker failed may be sent again, and to whom.

A failed exchange is waited out only once the supervisor says the worker is lost: a killed
server is seen within a second (its process exits), a dead engine core within its failed
probes, a hang before its processes are killed (which is what breaks the exchange). If it does
not say so within `resume.confirm_s`, the worker still serves and the failure is the client's
error; the new worker's start is waited for up to `resume.max_wait_s` in all.
"""

from __future__ import annotations

import asyncio

import structlog

from appliance.engine import EngineState, EngineView
from appliance.errors import ApiError, EngineUnavailable, UpstreamError
from appliance.fences.vllm import ENGINE_DEAD_MESSAGE

log = structlog.get_logger("appliance.recovery")

_HOPELESS = (EngineState.FAILED, EngineState.STOPPED)  # no worker comes back by itself


def engine_died() -> UpstreamError:
    """What the worker said in its stream (its own error event): its engine core died."""
    return UpstreamError(500, ENGINE_DEAD_MESSAGE, param=None, code="engine_error")


def engine_fault(error: ApiError) -> bool:
    """The worker stopped answering (its connection broke or failed), or it answered that its
    engine core died: vLLM's API server says so with a 500 and then exits."""
    if isinstance(error, EngineUnavailable):
        return True
    return isinstance(error, UpstreamError) and error.status >= 500 \
        and ENGINE_DEAD_MESSAGE in error.message


async def loss_confirmed(engine: EngineView, serial: int, max_wait_s: float) -> bool:
    """Whether the supervisor declares the worker numbered `serial` lost (it stops being the
    one that serves) within `max_wait_s`; it has then read which requests were in flight."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_wait_s
    while engine.serial == serial and engine.state is EngineState.READY:
        if engine.stop_requested or loop.time() >= deadline:
            return False
        await engine.changed(deadline - loop.time())
    return True


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
