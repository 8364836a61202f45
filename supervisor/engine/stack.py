"""One model's worker and everything that watches it: its manager (state, restarts, backoff,
crash loop), its monitors (health probe, progress and hang watch, the GPU), its launcher and
template, its forensics, its canary and its ledger of requests waiting on it. Each model of the
catalog gets one, so that one model's fault, restart or quarantine never touches another's."""

from __future__ import annotations

from dataclasses import dataclass

import structlog

from appliance.app import ApiState
from appliance.core.catalog import CatalogEntry
from appliance.core.engine import Waiting
from appliance.core.sections import EngineSettings
from appliance.core.settings import Settings
from appliance.fences.vllm import Env, Flag
from supervisor.engine.gpu_budget import Reservation
from supervisor.engine.launcher import TemplateLauncher, build_launcher
from supervisor.engine.manager import EngineManager
from supervisor.engine.probe import HttpProber
from supervisor.engine.sleep import SleepMode
from supervisor.engine.worker import ProcessLauncher
from supervisor.forensics.recorder import Recorder
from supervisor.gpu.device import device_env
from supervisor.gpu.watch import GpuWatch
from supervisor.monitors import Monitor
from supervisor.monitors.gpu import GpuHealthMonitor
from supervisor.monitors.health import HealthMonitor
from supervisor.monitors.progress import ProgressMonitor, WorkerDemand
from supervisor.monitors.stillness import Stillness, server_activity
from supervisor.observe.collector import ObservedModel
from supervisor.selftest.canary import CanaryWatch

log = structlog.get_logger("supervisor.engine.stack")


@dataclass
class ModelStack:
    """A model's worker under its own supervision (built by `build_stack`)."""

    entry: CatalogEntry
    settings: Settings  # the tree as this model reads it (its engine settings)
    manager: EngineManager
    progress: ProgressMonitor
    prober: HttpProber
    launcher: TemplateLauncher | ProcessLauncher
    canary: CanaryWatch
    waiting: Waiting

    @property
    def name(self) -> str:
        return self.entry.name

    def owed(self) -> int:
        """Requests the API sent this model's worker and holds unanswered."""
        return len(self.waiting)

    def observed(self) -> ObservedModel:
        return ObservedModel(self.name, self.manager, self.progress, self.canary)

    async def aclose(self) -> None:
        await self.canary.aclose()
        await self.prober.aclose()
        await self.launcher.aclose()


def build_stack(settings: Settings, entry: CatalogEntry, api: ApiState, gpu: GpuWatch | None,
                reservation: Reservation | None, *, loaded: bool = True) -> ModelStack:
    """`settings` is the whole tree; the stack reads it with the model's own engine settings.
    `reservation`: its sized GPU share (None on the CPU, or unsized). `loaded`: start a worker
    at once (else when residency loads the model)."""
    own = entry.settings(settings)
    sup, engine = own.supervisor, own.engine
    prober = HttpProber(engine.base_url, engine.model_name, sup.health_timeout_s)
    # Only requests the API sends make the engine work: while none is, it is not read again;
    # while some wait on it, they are work even if the worker's own gauges froze.
    waiting = Waiting(own.policy.max_inflight)
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
    launcher = build_launcher(worker_settings(own, reservation, gpu.uuid if gpu else None,
                                              sleep=entry.sleep),
                              own.policy.allowed_media_hosts)
    # Each death's in-flight requests are counted against them: one that keeps killing the
    # engine is refused (request_quarantined) before it trips the crash-loop guard; one that
    # a worker answered in full, and lived, is cleared of them.
    waiting.answered.append(api.quarantine.answered)
    forensics = Recorder(own, waiting, metrics=lambda: progress.stats,
                         gpu=lambda: gpu.summary() | {"gauges": gpu.gauges()} if gpu is not None
                         else {"status": "unavailable"}, deaths=api.quarantine.died)
    sleeper = SleepMode(prober.ask, settings.residency.sleep_timeout_s) if entry.sleep else None
    manager = EngineManager(own, launcher, prober, monitors, gpu=gpu, waiting=waiting,
                            forensics=forensics, loaded=loaded, sleeper=sleeper)
    # Each worker, once ready, answers the correctness canary in the background.
    canary = CanaryWatch(engine, own.canary, prober.ask, lambda: manager.pid)
    manager.listeners.append(canary.on_state)
    manager.details["canary"] = canary.summary
    return ModelStack(entry, own, manager, progress, prober, launcher, canary, waiting)


def worker_settings(settings: Settings, reservation: Reservation | None = None,
                    gpu_uuid: str | None = None, *, sleep: bool = False) -> EngineSettings:
    """The engine's settings with the sized GPU reservation, on the GPU the monitor watches,
    vLLM's priority scheduler where clients have priorities, and on a GPU its sleep mode where
    the model sleeps (models.<name>.sleep; its /sleep and /wake_up are dev routes, on the
    worker's private socket like all its routes). The operator's own engine.env and
    engine.extra_args come after, and win."""
    engine = settings.engine
    update: dict[str, object] = {}
    flags: list[str] = []
    if reservation is not None:
        update["gpu_memory_utilization"] = reservation.utilization
    if engine.resolved_device() == "cuda":
        dev: dict[str, str] = {Env.SERVER_DEV_MODE: "1"} if sleep else {}
        update["env"] = {**device_env(settings.gpu, gpu_uuid), **dev, **engine.env}
        flags += [Flag.ENABLE_SLEEP_MODE] if sleep else []
    if settings.admission.engine_priority():
        flags += ["--scheduling-policy", "priority"]
    if flags:
        update["extra_args"] = [*flags, *engine.extra_args]
    return engine.model_copy(update=update)
