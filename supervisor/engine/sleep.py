"""vLLM's sleep mode, as the engine manager asks for it: put a worker to sleep, wake it up.

A worker started with sleep mode (models.<name>.sleep, on a CUDA GPU) serves vLLM's dev routes
on its private socket (appliance.fences.vllm names them and the answers read here). Level 1
moves its weights to host memory and discards its KV cache; waking copies them back, so a swap
back to the model is a wake-up instead of a load. Each call answers None where the worker did
what was asked, else why not (a status, a body that says otherwise, no answer in time): the
manager then stops the worker instead, or stops it and starts a new one.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

from appliance.fences.vllm import SLEEP_PATH, WAKE_UP_PATH

Ask = Callable[[str, str, bytes | None, float], Awaitable[tuple[int, bytes] | None]]


class SleepMode:
    """The worker's /sleep and /wake_up, through the prober's `ask` (never raises)."""

    def __init__(self, ask: Ask, timeout_s: float) -> None:
        self._ask = ask
        self.timeout_s = timeout_s

    async def sleep(self) -> str | None:
        """Level 1; requests still in flight finish first (residency drained the model)."""
        return await self._call(SLEEP_PATH, "sleeping")

    async def wake_up(self) -> str | None:
        """Every tag (weights and KV cache) woken: "awake", not "sleeping" (some tag still is)."""
        return await self._call(WAKE_UP_PATH, "awake")

    async def _call(self, path: str, status: str) -> str | None:
        answer = await self._ask("POST", path, None, self.timeout_s)
        if answer is None:
            return f"POST {path}: no answer within {self.timeout_s:g}s"
        code, body = answer
        if not 200 <= code < 300:
            return f"POST {path}: HTTP {code}"
        try:
            told = json.loads(body).get("status")
        except (ValueError, AttributeError):
            told = None
        if told != status:
            return f"POST {path}: status {told!r}, not {status!r}"
        return None
