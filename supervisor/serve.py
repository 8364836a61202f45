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
from prometheus_client import CollectorRegistry, Histogram

from appliance.app import ApiState, api_server, create_app
from appliance.core.catalog import Catalog
from appliance.core.engine import EngineState
from appliance.core.sections import GpuSettings
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
from supervisor.engine.listen import ListenError, prepare_socket_dir
from supervisor.engine.manager import EngineManager
from supervisor.engine.planner import PlanError, plan_memory
from supervisor.engine.residency import Residency
from supervisor.engine.stack import ModelStack, build_stack
from supervisor.gpu.watch import build_gpu_watch
from supervisor.observe.collector import SupervisorCollector, restart_durations
from supervisor.observe.signals import LoadSignals
from supervisor.operator.control import control_socket
from supervisor.operator.private import private_dir
from supervisor.operator.reload import Reloader
from supervisor.operator.sdnotify import Notifier
from supervisor.operator.tls import ServerTls

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

    # 1. One stack per model of the catalog: its manager, monitors, launcher, forensics and
    #    canary; the GPU monitor is shared (absent GPU: probes alone).
    catalog = Catalog.from_settings(settings)
    prepare_cache_dir(engine.resolved_cache_dir())
    try:
        for entry in catalog:  # the default's directory first: the others' are inside it
            prepare_socket_dir(entry.engine)
    except (ListenError, OSError) as exc:
        log.error("engine.socket_dir_refused", error=str(exc))
        return EXIT_FAILURE
    reservations = {entry.name: size_gpu_reservation(entry.settings(settings))
                    for entry in catalog}
    # With several models, which fit in memory together; one that never can is refused here.
    try:
        memory_plan = plan_memory(catalog, settings.residency, settings.gpu, reservations) \
            if len(catalog) > 1 else None
        if memory_plan is not None:
            memory_plan.check(catalog)
    except PlanError as exc:
        log.error("supervisor.bad_configuration", error=str(exc))
        return EXIT_CONFIG
    gpu = await build_gpu_watch(settings.gpu)
    api = ApiState.from_settings(settings)
    # Residency where models may be unloaded (a limit, not all fitting together, or an idle
    # timeout): the models beyond the limit start unloaded, and a request loads them.
    swapping = settings.residency.max_loaded is not None \
        or (memory_plan is not None and not memory_plan.fits(memory_plan.reservations)) \
        or any(entry.keep_alive_s is not None for entry in catalog)
    first = Residency.initially_loaded(catalog.entries, settings.residency, memory_plan)
    stacks = [build_stack(settings, entry, api, gpu, reservations[entry.name],
                          loaded=entry.name in first) for entry in catalog]
    residency = Residency([(s.entry, s.manager) for s in stacks], settings.residency,
                          plan=memory_plan) if swapping else None
    default = stacks[0]
    for stack in stacks:
        stack.manager.listeners.append(functools.partial(_report_state, notifier, stack,
                                                         len(stacks)))
    if len(stacks) > 1:
        log.info("models.catalog", models=[stack.name for stack in stacks], default=default.name)

    # 2. Metrics: the supervisor's facts, read at scrape time, in the registry the API serves.
    registry = CollectorRegistry()
    registry.register(SupervisorCollector([s.observed() for s in stacks], gpu))
    # The load signals a router reads, in vLLM's names (the fleet's balancing); the admission
    # queue is the whole box's, counted once, with the default model.
    registry.register(LoadSignals([(s.manager, s.progress, s.owed) for s in stacks],
                                  lambda: api.admission.queued))
    if residency is not None:
        registry.register(residency.collector())
    durations = restart_durations(registry)
    for stack in stacks:
        stack.manager.phase_listeners.append(functools.partial(_observe_phase, durations,
                                                               stack.name))

    # 3. The API on the LAN; READY=1 once it listens, before the model loads (it answers 503).
    manager_tasks: list[asyncio.Task[None]] = []
    reloader = Reloader(api.clients, tls)
    # SIGHUP (kill -HUP) reloads as `chat-appliance reload` (systemctl reload) does.
    loop.add_signal_handler(signal.SIGHUP, reloader.on_signal)
    app = create_app(settings, default.manager, registry=registry, admission=api.admission,
                     clients=api.clients, models={s.name: s.manager for s in stacks},
                     residency=residency,
                     alive=lambda: bool(manager_tasks) and not any(t.done() for t in manager_tasks),
                     engine_reading=lambda: default.progress.stats
                     if default.manager.state is EngineState.READY else None,
                     quarantine=api.quarantine)
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

    # 4. The workers, and the watchdog ping that proves this loop still turns.
    managers = [stack.manager for stack in stacks]
    manager_tasks += [asyncio.create_task(manager.run()) for manager in managers]
    idle = asyncio.create_task(residency.run()) if residency is not None else None
    watchdog = asyncio.create_task(_watchdog(notifier, managers, *manager_tasks, server_task))

    # 5. Run until a signal, or until the API or a manager ends on its own.
    await _first(signals.first.wait(), *manager_tasks, server_task)
    failed = server_task.done() or any(task.done() for task in manager_tasks)
    log.info("supervisor.stopping", cause="internal failure" if failed else signals.cause)
    notifier.stopping()
    # READY=1 went out when the API listened, so model loads need no extension; a drain
    # configured longer than the unit's TimeoutStopSec does.
    notifier.extend_timeout(sup.drain_timeout_s + sup.stop_grace_s + 30)

    # 6. Drain: 503 for anything new, in-flight requests finish up to the drain timeout.
    if idle is not None:  # nothing is loaded or unloaded while the box stops
        idle.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await idle
    for manager in managers:
        manager.begin_drain()
    await _drain(api, sup.drain_timeout_s, signals.second)

    # 7. Stop the workers (group SIGTERM, grace, SIGKILL, reap), then the API.
    for manager in managers:
        manager.request_stop()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.gather(*manager_tasks)
    watchdog.cancel()
    # systemd keeps the watchdog armed while the unit stops: the rest of the stop (the clients'
    # close, the template's exit) must not read as a frozen loop. TimeoutStopSec bounds it.
    stopping = asyncio.create_task(_keep_alive(notifier))
    server.stop()
    with contextlib.suppress(asyncio.CancelledError, SystemExit):
        await server_task
    await operator.aclose()
    for stack in stacks:
        await stack.aclose()
    if gpu is not None:
        await gpu.aclose()
    stopping.cancel()
    log.info("supervisor.stopped", restarts={s.name: s.manager.restarts for s in stacks})
    return EXIT_FAILURE if failed else EXIT_OK


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


async def _watchdog(notifier: Notifier, managers: list[EngineManager],
                    *tasks: asyncio.Task[None]) -> None:
    """WATCHDOG=1 only while the API runs and the manager's loop still turns; a frozen event
    loop sends nothing at all, so systemd restarts the service either way."""
    interval = notifier.watchdog_interval_s()
    if interval is None:
        return
    while all(not task.done() for task in tasks):
        stuck = [manager for manager in managers if not manager.loop_is_turning()]
        if not stuck:
            notifier.watchdog()
        for manager in stuck:
            log.error("supervisor.manager_stuck", model=manager.model_name,
                      since_s=round(time.monotonic() - manager.last_tick))
        await asyncio.sleep(interval)


async def _keep_alive(notifier: Notifier) -> None:
    """WATCHDOG=1 for as long as the loop turns, whatever else happens (the stop's last steps)."""
    interval = notifier.watchdog_interval_s()
    while interval is not None:
        notifier.watchdog()
        await asyncio.sleep(interval)


def _observe_phase(durations: Histogram, model: str, phase: str, seconds: float) -> None:
    durations.labels(phase=phase, model=model).observe(seconds)


def _report_state(notifier: Notifier, stack: ModelStack, models: int, _old: EngineState,
                  state: EngineState, cause: str) -> None:
    """systemd's STATUS line: the model's name where the catalog holds several."""
    named = f"model {stack.name}: " if models > 1 else ""
    notifier.status(f"{named}engine {state.value} ({cause}); restarts {stack.manager.restarts}")
