"""`chat-appliance serve`: start-up and shutdown of the supervisor, as numbered steps."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry

from appliance.app import ApiState, api_server, create_app
from appliance.core.engine import EngineState, Waiting
from appliance.core.sections import EngineSettings, GpuSettings
from appliance.core.settings import ConfigError, Settings
from appliance.fences.uvicorn import ApiServer
from supervisor.engine.gpu_budget import (
    GpuMemory,
    ModelShapeError,
    Reservation,
    plan,
    read_gpu_memory,
    read_model_shape,
)
from supervisor.engine.launcher import build_launcher
from supervisor.engine.listen import ListenError, prepare_socket_dir
from supervisor.engine.manager import EngineManager
from supervisor.engine.probe import HttpProber
from supervisor.forensics.recorder import Recorder
from supervisor.gpu.device import device_env
from supervisor.gpu.watch import build_gpu_watch
from supervisor.monitors import Monitor
from supervisor.monitors.gpu import GpuHealthMonitor
from supervisor.monitors.health import HealthMonitor
from supervisor.monitors.progress import ProgressMonitor, WorkerDemand
from supervisor.monitors.stillness import Stillness, server_activity
from supervisor.observe.collector import SupervisorCollector, restart_durations
from supervisor.observe.signals import LoadSignals
from supervisor.operator.control import control_socket
from supervisor.operator.private import private_dir
from supervisor.operator.reload import Reloader
from supervisor.operator.sdnotify import Notifier
from supervisor.operator.tls import ServerTls
from supervisor.selftest.canary import CanaryWatch

log = structlog.get_logger("supervisor.serve")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_CONFIG = 2  # the unit's RestartPreventExitStatus


class Signals:
    """Signal handlers only record; the serve loop acts. A second signal forces the stop.
    `chat-appliance drain` on the control socket asks for the same stop as SIGTERM."""

    def __init__(self) -> None:
        self.count = 0
        self.first = asyncio.Event()
        self.second = asyncio.Event()
        self.cause = "signal"

    def install(self, loop: asyncio.AbstractEventLoop) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._record, sig)

    def drain(self, in_flight: Callable[[], int], timeout_s: float) -> dict[str, object]:
        """The control socket's `drain`: not ready at once, then the stop SIGTERM makes."""
        if not self.first.is_set():
            self.cause = "drain command"
            log.info("supervisor.drain_requested", in_flight=in_flight())
            self.first.set()
        return {"draining": True, "in_flight": in_flight(), "drain_timeout_s": timeout_s}

    def _record(self, sig: signal.Signals) -> None:
        self.count += 1
        log.info("supervisor.signal", signal=sig.name, count=self.count)
        (self.first if self.count == 1 else self.second).set()


def prepare_cache_dir(path: Path) -> bool:
    """The worker's cache root must exist and be writable, or every restart compiles again: say
    so once at start (a warning, not a failure; the worker still runs, only slower to restart)."""
    try:
        private_dir(path)
        probe = path / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        log.warning("engine.cache_unwritable", path=str(path), error=error.strerror or str(error),
                    hint="set engine.cache_dir to a writable directory (ReadWritePaths under systemd)")
        return False
    log.info("engine.cache_dir", path=str(path))
    return True


async def serve(settings: Settings) -> int:
    # 0. A certificate that does not load is a configuration error: no restart would fix it.
    try:
        tls = ServerTls.from_settings(settings.server)
    except ConfigError as exc:
        log.error("supervisor.bad_configuration", error=str(exc))
        return EXIT_CONFIG
    loop = asyncio.get_running_loop()
    signals = Signals()
    signals.install(loop)
    notifier = Notifier.from_env()
    sup, engine = settings.supervisor, settings.engine

    # 1. The engine manager, its monitors and the GPU monitor (absent GPU: probes alone).
    prepare_cache_dir(engine.resolved_cache_dir())
    try:
        prepare_socket_dir(engine)
    except (ListenError, OSError) as exc:
        log.error("engine.socket_dir_refused", error=str(exc))
        return EXIT_FAILURE
    gpu = await build_gpu_watch(settings.gpu)
    prober = HttpProber(engine.base_url, engine.model_name, sup.health_timeout_s)
    api = ApiState.from_settings(settings)
    # Only requests the API sends make the engine work: while none is, it is not read again;
    # while some wait on it, they are work even if the worker's own gauges froze.
    waiting = Waiting(settings.policy.max_inflight)
    progress = ProgressMonitor(
        prober, sup, demand=lambda: WorkerDemand(len(waiting), waiting.sent, waiting.unanswered()),
        stillness=Stillness(sup, "/metrics"), server=server_activity)
    monitors: list[Monitor] = [
        HealthMonitor(prober, interval_s=sup.health_interval_s, failures=sup.health_failures,
                      stillness=Stillness(sup, "/health")),
        progress,
    ]
    if gpu is not None:
        monitors.append(GpuHealthMonitor(gpu))
    reservation = size_gpu_reservation(settings)
    launcher = build_launcher(worker_settings(settings, reservation, gpu.uuid if gpu else None),
                              settings.policy.allowed_media_hosts)
    # Each death's in-flight requests are counted against them: one that keeps killing the
    # engine is refused (request_quarantined) before it trips the crash-loop guard; one that
    # a worker answered in full, and lived, is cleared of them.
    waiting.answered.append(api.quarantine.answered)
    forensics = Recorder(settings, waiting, metrics=lambda: progress.stats,
                         gpu=lambda: gpu.summary() | {"gauges": gpu.gauges()} if gpu is not None
                         else {"status": "unavailable"}, deaths=api.quarantine.died)
    manager = EngineManager(settings, launcher, prober, monitors, gpu=gpu, waiting=waiting,
                            forensics=forensics)
    manager.listeners.append(lambda old, new, cause: _report_state(notifier, manager, new, cause))
    # Each worker, once ready, answers the correctness canary in the background.
    canary = CanaryWatch(engine, settings.canary, prober.ask, lambda: manager.pid)
    manager.listeners.append(canary.on_state)
    manager.details["canary"] = canary.summary

    # 2. Metrics: the supervisor's facts, read at scrape time, in the registry the API serves.
    registry = CollectorRegistry()
    registry.register(SupervisorCollector(manager, progress, gpu, canary))
    # The load signals a router reads, in vLLM's names (the fleet's balancing).
    registry.register(LoadSignals(manager, progress, lambda: api.admission.queued,
                                  lambda: len(waiting)))
    durations = restart_durations(registry)
    manager.phase_listeners.append(lambda phase, s: durations.labels(phase=phase).observe(s))

    # 3. The API on the LAN; READY=1 once it listens, before the model loads (it answers 503).
    manager_task: asyncio.Task[None] | None = None
    reloader = Reloader(api.clients, tls)
    # SIGHUP (kill -HUP) reloads as `chat-appliance reload` (systemctl reload) does.
    loop.add_signal_handler(signal.SIGHUP, reloader.on_signal)
    app = create_app(settings, manager, registry=registry, admission=api.admission, clients=api.clients,
                     alive=lambda: manager_task is not None and not manager_task.done(),
                     engine_reading=lambda: progress.stats if manager.state is EngineState.READY
                     else None, quarantine=api.quarantine)
    server = api_server(settings, app, registry, None if tls is None else lambda: tls.context)
    server_task = asyncio.create_task(_run_server(server))
    if not await _wait_listening(server, server_task):
        log.error("supervisor.api_failed", host=settings.server.host, port=settings.server.port)
        return EXIT_FAILURE
    log.info("supervisor.listening", host=settings.server.host, port=settings.server.port,
             tls=tls is not None, fingerprint=tls.fingerprint if tls is not None else None)
    notifier.ready(f"API listening on {settings.server.port}; engine starting")
    # The operator's door (reload, drain), a Unix socket no web page can reach; closed last.
    operator = contextlib.AsyncExitStack()
    drain = functools.partial(signals.drain, lambda: api.admission.in_flight, sup.drain_timeout_s)
    await operator.enter_async_context(control_socket(
        settings.server.resolved_control_socket(), {"reload": reloader, "drain": drain}))
    # What start-up built (modules, the app, its routes and models) lives as long as the
    # process: out of the collector's sight, so that the full collections that many requests
    # in flight provoke do not walk it again each time (GC time in a non-streaming load run
    # on the synthetic worker, gc.callbacks: 2.0 -> 1.2 s).
    gc.collect()
    gc.freeze()

    # 4. The worker, and the watchdog ping that proves this loop still turns.
    manager_task = asyncio.create_task(manager.run())
    watchdog = asyncio.create_task(_watchdog(notifier, manager, manager_task, server_task))

    # 5. Run until a signal, or until the API or the manager ends on its own.
    await _first(signals.first.wait(), manager_task, server_task)
    failed = server_task.done() or manager_task.done()
    log.info("supervisor.stopping", cause="internal failure" if failed else signals.cause)
    notifier.stopping()
    # READY=1 went out when the API listened, so model loads need no extension; a drain
    # configured longer than the unit's TimeoutStopSec does.
    notifier.extend_timeout(sup.drain_timeout_s + sup.stop_grace_s + 30)

    # 6. Drain: 503 for anything new, in-flight requests finish up to the drain timeout.
    manager.begin_drain()
    await _drain(api, sup.drain_timeout_s, signals.second)

    # 7. Stop the worker (group SIGTERM, grace, SIGKILL, reap), then the API.
    manager.request_stop()
    with contextlib.suppress(asyncio.CancelledError):
        await manager_task
    watchdog.cancel()
    # systemd keeps the watchdog armed while the unit stops: the rest of the stop (the clients'
    # close, the template's exit) must not read as a frozen loop. TimeoutStopSec bounds it.
    stopping = asyncio.create_task(_keep_alive(notifier))
    server.stop()
    with contextlib.suppress(asyncio.CancelledError, SystemExit):
        await server_task
    await operator.aclose()
    await canary.aclose()
    await prober.aclose()
    await launcher.aclose()
    if gpu is not None:
        await gpu.aclose()
    stopping.cancel()
    log.info("supervisor.stopped", restarts=manager.restarts)
    return EXIT_FAILURE if failed else EXIT_OK


def worker_settings(settings: Settings, reservation: Reservation | None = None,
                    gpu_uuid: str | None = None) -> EngineSettings:
    """The engine's settings with the sized GPU reservation, on the GPU the monitor watches, and
    vLLM's priority scheduler where clients have priorities (the operator's own engine.env and
    engine.extra_args come after, and win)."""
    engine = settings.engine
    update: dict[str, object] = {}
    if reservation is not None:
        update["gpu_memory_utilization"] = reservation.utilization
    if engine.resolved_device() == "cuda":
        update["env"] = {**device_env(settings.gpu, gpu_uuid), **engine.env}
    if settings.admission.engine_priority():
        update["extra_args"] = ["--scheduling-policy", "priority", *engine.extra_args]
    return engine.model_copy(update=update)


def size_gpu_reservation(
    settings: Settings, read_memory: Callable[[GpuSettings], GpuMemory | None] = read_gpu_memory,
) -> Reservation | None:
    """The GPU reservation for this model and the memory free now, logged with its numbers;
    None on the CPU, or where it cannot be sized (vLLM's own default then applies, logged)."""
    engine = settings.engine
    if engine.resolved_device() != "cuda":
        return None
    memory = read_memory(settings.gpu)
    if memory is None:
        log.warning("engine.gpu_reservation_unsized", error="NVML gave no memory reading")
        return None
    try:
        shape = read_model_shape(Path(engine.model), engine.dtype)
    except ModelShapeError as error:
        log.warning("engine.gpu_reservation_unsized", error=str(error))
        return None
    reservation = plan(settings, shape, memory)
    log.info("engine.gpu_reservation", **reservation.as_dict())
    return reservation


async def _run_server(server: ApiServer) -> None:
    try:
        await server.serve()
    except SystemExit:  # uvicorn exits this way when it cannot bind
        log.error("supervisor.api_exit")


async def _wait_listening(server: ApiServer, task: asyncio.Task[None]) -> bool:
    while not server.started:
        if task.done():
            return False
        await asyncio.sleep(0.05)
    return True


async def _first(*awaitables: Awaitable[object]) -> None:
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    for task, original in zip(tasks, awaitables, strict=True):
        if task is not original:
            task.cancel()


async def _drain(api: ApiState, timeout_s: float, forced: asyncio.Event) -> None:
    deadline = time.monotonic() + timeout_s
    # Polled: the in-flight count has no event of its own, and 0.1 s is nothing next to a drain.
    while api.admission.in_flight > 0 and time.monotonic() < deadline and not forced.is_set():  # noqa: ASYNC110
        await asyncio.sleep(0.1)
    log.info("supervisor.drained", left=api.admission.in_flight, forced=forced.is_set())


async def _watchdog(notifier: Notifier, manager: EngineManager,
                    *tasks: asyncio.Task[None]) -> None:
    """WATCHDOG=1 only while the API runs and the manager's loop still turns; a frozen event
    loop sends nothing at all, so systemd restarts the service either way."""
    interval = notifier.watchdog_interval_s()
    if interval is None:
        return
    while all(not task.done() for task in tasks):
        if manager.loop_is_turning():
            notifier.watchdog()
        else:
            log.error("supervisor.manager_stuck", since_s=round(time.monotonic() - manager.last_tick))
        await asyncio.sleep(interval)


async def _keep_alive(notifier: Notifier) -> None:
    """WATCHDOG=1 for as long as the loop turns, whatever else happens (the stop's last steps)."""
    interval = notifier.watchdog_interval_s()
    while interval is not None:
        notifier.watchdog()
        await asyncio.sleep(interval)


def _report_state(notifier: Notifier, manager: EngineManager, state: EngineState,
                  cause: str) -> None:
    notifier.status(f"engine {state.value} ({cause}); restarts {manager.restarts}")
