"""Checks that disturb the engine: a client's disconnect, kill -9 of the worker, a frozen
EngineCore. Each measures how long the appliance took and proves the old worker's processes
(and, on a GPU, their memory) are gone."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import psutil

from supervisor.selftest.report import Check, CheckFailed
from supervisor.selftest.target import Target, engine_core, worker_stats, worker_tree

ABORT_BAR_S = 0.5  # docs/DESIGN.md: disconnect → engine abort
ABORT_BUDGET = 2000  # tokens the abandoned stream asked for: far more than it can make meanwhile
HANG_DECLARED_S = 60.0  # the hang is declared well within this (DESIGN: 10 s of no progress)
GPU_RELEASE_S = 30.0

# The old worker's processes that still live; each fault check hands them here.
Leftovers = Callable[[set[int]], list[int]]
# The old worker's pids still holding GPU memory; None where no GPU (or NVML) is seen.
GpuHolders = Callable[[set[int]], set[int] | None]


def alive(pids: set[int]) -> list[int]:
    left = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.Error):
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                left.append(pid)
    return left


def disconnect(target: Target) -> Check:
    """A stream abandoned after a few events: the engine stops it (its own gauges say so)."""
    pid = target.worker_pid()
    try:
        before = worker_stats(pid)
    except (OSError, httpx.HTTPError, psutil.Error) as exc:
        return Check("disconnect aborts the engine's work", None,
                     f"the worker's own metrics are out of reach ({exc}): run as root or the "
                     "service user")
    with target.client.stream("POST", "/v1/completions", json={
            "model": target.model, "prompt": "Count: 1, 2, 3,", "stream": True,
            "max_tokens": ABORT_BUDGET, "ignore_eos": True}) as response:
        if response.status_code != 200:
            raise CheckFailed(f"the stream answered {response.status_code}")
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data:")
            if events >= 3:
                break
    closed = time.monotonic()
    while (now := worker_stats(pid)).running > before.running:
        if time.monotonic() - closed > 30:
            raise CheckFailed("the engine still runs the abandoned request after 30 s")
        time.sleep(0.02)
    aborted_s = time.monotonic() - closed
    generated = int(now.generation_tokens - before.generation_tokens)
    measured: dict[str, Any] = {"aborted_s": round(aborted_s, 3), "generated": generated}
    if generated >= ABORT_BUDGET:
        raise CheckFailed(f"the request ran to its end ({generated} tokens): never aborted")
    ok = aborted_s <= ABORT_BAR_S
    return Check("disconnect aborts the engine's work", ok,
                 f"aborted {aborted_s:.2f} s after the client left (bar {ABORT_BAR_S} s), "
                 f"{generated} of {ABORT_BUDGET} tokens made", measured)


def kill_worker(target: Target, gpu_holders: GpuHolders) -> Check:
    """kill -9 of the worker's API server: the appliance reaps its tree and is ready again."""
    old = target.worker_pid()
    pids = {proc.pid for proc in worker_tree(old)} | {old}
    started = time.monotonic()
    os.kill(old, signal.SIGKILL)
    detail = target.wait_ready(other_than=old)
    ready_s = time.monotonic() - started
    return _recovered("kill -9 → ready", detail, pids, ready_s, {"ready_s": round(ready_s, 2)},
                      gpu_holders)


def freeze_engine(target: Target, gpu_holders: GpuHolders) -> Check:
    """SIGSTOP of EngineCore while a request waits on it: declared hung, restarted, and the
    request still answered (sent again to the new worker)."""
    old = target.worker_pid()
    pids = {proc.pid for proc in worker_tree(old)} | {old}
    core = engine_core(old)
    answers: list[int] = []
    asker = threading.Thread(target=lambda: answers.append(target.post(
        "/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hello."}],
                                 "max_tokens": 4}, timeout=300).status_code), daemon=True)
    core.suspend()
    try:
        started = time.monotonic()
        asker.start()
        declared_s = target.wait_not_ready(HANG_DECLARED_S)
        detail = target.wait_ready(other_than=old)
    except BaseException:
        with contextlib.suppress(psutil.Error):
            core.resume()  # never leave the operator's engine frozen by a failed check
        raise
    ready_s = time.monotonic() - started
    asker.join(120)
    measured = {"declared_s": round(declared_s, 2), "ready_s": round(ready_s, 2),
                "request_status": answers[0] if answers else None}
    check = _recovered("freeze → ready", detail, pids, ready_s, measured, gpu_holders)
    if answers != [200]:
        check.ok = False
        check.detail += f"; the request in flight got {answers or 'no answer'}, not 200"
    else:
        check.detail = f"hang declared in {declared_s:.1f} s; " + check.detail
    return check


def _recovered(name: str, detail: dict[str, Any], pids: set[int], ready_s: float,
               measured: dict[str, Any], gpu_holders: GpuHolders) -> Check:
    """The verdict of a fault: ready again, nothing of the old worker left, its memory free."""
    left = alive(pids)
    held = _wait_released(pids, gpu_holders)
    reason = (detail.get("last_exit") or {}).get("reason")
    measured |= {"old_processes": len(pids), "left": len(left), "exit_reason": reason,
                 "gpu_memory_released": None if held is None else not held}
    problems = ([f"{len(left)} old processes left: {left}"] if left else []) + (
        [f"old pids {sorted(held)} still hold GPU memory"] if held else [])
    words = (f"ready again in {ready_s:.1f} s (exit: {reason}); {len(pids)} old processes gone"
             + ("" if held is None else ", GPU memory released"))
    return Check(name, not problems, "; ".join(problems) or words, measured)


def _wait_released(pids: set[int], gpu_holders: GpuHolders) -> set[int] | None:
    deadline = time.monotonic() + GPU_RELEASE_S
    while (held := gpu_holders(pids)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return held
