"""The self-test's order of checks: the box, what clients see, the canary, then the faults, and
the canary again on the worker that replaced the frozen one."""

from __future__ import annotations

import time
from collections.abc import Callable

from appliance.core.settings import Settings
from supervisor.doctor.report import Finding, Level
from supervisor.gpu.nvml import GpuMonitor
from supervisor.selftest import faults
from supervisor.selftest.protocols import CLIENT_CHECKS
from supervisor.selftest.report import Check, CheckFailed, Report, timed
from supervisor.selftest.target import Target

CANARY_WAIT_S = 120.0  # a worker's canary: a few short greedy answers, behind other requests

DISTURBS = [
    "a few short requests through every API (they count in its metrics and rates)",
    "one stream abandoned mid-way (counted as a disconnect abort)",
    "kill -9 of the worker: a restart, requests in flight wait for it (resumed, not failed)",
    "SIGSTOP of EngineCore: declared hung, a restart and a crash bundle",
]


def doctor_check(findings: list[Finding]) -> Check:
    blockers = [f"{f.check}: {f.message}" for f in findings if f.level is Level.BLOCKER]
    warnings = [f"{f.check}: {f.message}" for f in findings if f.level is Level.WARNING]
    measured: dict[str, str | int | float | bool | None] = {
        f.check: f.level.value for f in findings}
    words = "; ".join(blockers or warnings) or f"{len(findings)} checks fine"
    return Check("doctor", not blockers, words, measured)


def canary_check(target: Target, name: str) -> Check:
    """The verdict of the worker serving now, as /health gives it once that worker is judged."""
    deadline = time.monotonic() + CANARY_WAIT_S
    while True:
        code, detail = target.health()
        verdict = detail.get("canary") or {}
        if verdict.get("verdict") == "disabled":
            return Check(name, None, "canary.enabled is false")
        if code == 200 and verdict.get("worker") == detail.get("pid"):
            break
        if time.monotonic() > deadline:
            raise CheckFailed(f"no canary verdict for worker {detail.get('pid')} "
                              f"within {CANARY_WAIT_S:.0f} s")
        time.sleep(0.2)
    ok = verdict.get("verdict") in ("pass", "recorded")
    return Check(name, ok, f"{verdict['verdict']}: {verdict.get('detail')}",
                 {"verdict": verdict["verdict"], "key": verdict.get("key")})


def _ready(target: Target) -> Check:
    started = time.monotonic()
    detail = target.wait_ready()
    return Check("engine ready", True, f"worker {detail['pid']} serving {detail.get('model')}",
                 {"waited_s": round(time.monotonic() - started, 1)})


def gpu_holders(settings: Settings) -> tuple[faults.GpuHolders, Callable[[], None]]:
    """Which of some pids hold GPU memory (None: no GPU seen), and how to close NVML."""
    monitor = GpuMonitor(settings.gpu)
    if settings.engine.resolved_device() == "cuda":
        monitor.open()

    def holders(pids: set[int]) -> set[int] | None:
        if not monitor.available:
            return None
        using = monitor.pids_using_memory()
        return None if using is None else using & pids

    return holders, monitor.close


def run_checks(report: Report, target: Target, settings: Settings,
               findings: list[Finding]) -> None:
    """Every check, in order, into `report`; a fault check is skipped once the engine is
    down for good (its verdict is already the failure before it)."""
    report.checks.append(doctor_check(findings))
    ready = timed("engine ready", lambda: _ready(target))
    report.checks.append(ready)
    if ready.ok is False:
        return
    for name, check in CLIENT_CHECKS:
        report.checks.append(timed(name, lambda c=check: c(target)))  # type: ignore[misc]
    report.checks.append(timed("canary", lambda: canary_check(target, "canary")))
    holders, close = gpu_holders(settings)
    try:
        report.checks.append(timed("disconnect aborts the engine's work",
                                   lambda: faults.disconnect(target)))
        report.checks.append(timed("kill -9 → ready",
                                   lambda: faults.kill_worker(target, holders)))
        report.checks.append(timed("freeze → ready",
                                   lambda: faults.freeze_engine(target, holders)))
    finally:
        close()
    report.checks.append(timed("canary after the faults",
                               lambda: canary_check(target, "canary after the faults")))
