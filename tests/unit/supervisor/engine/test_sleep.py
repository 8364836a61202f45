"""Sleep mode (models.<name>.sleep): the engine manager puts its worker to sleep when residency
unloads it and wakes it at the next load, over the synthetic worker's copy of vLLM 0.32's
/sleep and /wake_up; a failed sleep stops the worker, a failed wake-up restarts it, a death
while asleep is a crash, and nothing declares a sleeping worker hung or unhealthy. Then the
settings: the worker's flag and environment on a GPU, the refusal on the CPU."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import ValidationError

from appliance.core.catalog import Catalog, ResidencySettings
from appliance.core.engine import EngineState
from appliance.core.settings import Settings
from load.kit.synthetic_sleep import SleepRoutes
from load.kit.synthetic_worker import SyntheticWorker
from supervisor.engine.manager import EngineManager
from supervisor.engine.planner import MemoryPlan
from supervisor.engine.residency import Residency
from supervisor.engine.sleep import Ask, SleepMode
from supervisor.engine.stack import worker_settings
from supervisor.engine.worker import build_command, build_env
from tests.metrics_text import value
from tests.unit.supervisor.engine.test_manager import FakeClock, FakeLauncher, make_manager, until

pytestmark = pytest.mark.anyio
SLEEP = "POST /sleep?level=1&mode=wait"


@asynccontextmanager
async def worker_routes(fail: str | None = None) -> AsyncIterator[tuple[SleepRoutes, Ask]]:
    """The synthetic worker's sleep routes, and the prober's `ask` to it (over ASGI)."""
    routes = SleepRoutes(fail)
    app = SyntheticWorker(4, 0.0, "synthetic", sleep=routes)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://worker") as client:

        async def ask(method: str, path: str, body: bytes | None,
                      timeout_s: float) -> tuple[int, bytes] | None:
            try:
                answer = await client.request(method, path, content=body, timeout=timeout_s)
            except httpx.HTTPError:
                return None
            return answer.status_code, answer.content

        yield routes, ask


# --- the calls ------------------------------------------------------------------------------

async def test_sleep_asks_level_1_letting_requests_finish_and_wake_up_reads_awake() -> None:
    async with worker_routes() as (routes, ask):
        mode = SleepMode(ask, 5.0)
        assert await mode.sleep() is None and routes.sleeping and routes.level == 1
        assert (await ask("GET", "/is_sleeping", None, 1.0)) == (200, b'{"is_sleeping": true}')
        assert await mode.wake_up() is None and not routes.sleeping
        assert routes.calls == [SLEEP, "GET /is_sleeping", "POST /wake_up"]


async def test_a_500_no_answer_or_a_worker_still_asleep_is_a_failure_naming_why() -> None:
    async with worker_routes(fail="sleep") as (routes, ask):
        assert "HTTP 500" in (await SleepMode(ask, 5.0).sleep() or "")
        assert not routes.sleeping
    async with worker_routes(fail="wake_up") as (routes, ask):
        mode = SleepMode(ask, 5.0)
        assert await mode.sleep() is None
        assert "HTTP 500" in (await mode.wake_up() or "")

    async def silent(method: str, path: str, body: bytes | None,
                     timeout_s: float) -> tuple[int, bytes] | None:
        return None

    assert "no answer within 3s" in (await SleepMode(silent, 3.0).sleep() or "")

    async def half_awake(method: str, path: str, body: bytes | None,
                         timeout_s: float) -> tuple[int, bytes] | None:
        return 200, b'{"status": "sleeping", "tags": ["weights"]}'  # vLLM: a tag still asleep

    assert "'sleeping'" in (await SleepMode(half_awake, 3.0).wake_up() or "")


# --- the engine manager ---------------------------------------------------------------------

@dataclass
class Unloaded:
    """A serving manager with sleep mode, the moment after residency's unload()."""

    manager: EngineManager
    launcher: FakeLauncher
    routes: SleepRoutes
    clock: FakeClock


@asynccontextmanager
async def unloaded(fail: str | None = None, **supervisor: float) -> AsyncIterator[Unloaded]:
    clock, launcher = FakeClock(), FakeLauncher()
    async with worker_routes(fail) as (routes, ask):
        manager = make_manager(launcher, clock, sleeper=SleepMode(ask, 5.0), **supervisor)
        task = asyncio.create_task(manager.run())
        try:
            await until(lambda: manager.state is EngineState.READY)
            manager.unload()
            yield Unloaded(manager, launcher, routes, clock)
        finally:
            manager.request_stop()
            await task


async def test_unload_puts_the_worker_to_sleep_and_load_wakes_the_same_worker() -> None:
    async with unloaded(hang_stall_s=5) as it:
        manager, routes, clock = it.manager, it.routes, it.clock
        await until(lambda: manager.state is EngineState.SLEEPING)
        worker = it.launcher.current
        assert routes.calls == [SLEEP] and routes.sleeping
        assert worker.returncode is None and worker.stopped_with is None
        # Asleep, its /health fails and its engine looks busy and frozen: nothing reads them.
        worker.healthy, worker.busy, asleep_at = False, True, clock.now
        await until(lambda: clock.now > asleep_at + 3600)
        assert manager.state is EngineState.SLEEPING and manager.restarts == 0
        worker.healthy, worker.busy = True, False
        manager.load()
        await until(lambda: manager.state is EngineState.READY)
        assert routes.calls == [SLEEP, "POST /wake_up"] and not routes.sleeping
        assert (manager.pid, len(it.launcher.workers), manager.restarts) == (100, 1, 0)
        assert manager.sleep_counts == {"slept": 1, "woke": 1}


async def test_a_failed_wake_up_stops_the_worker_and_starts_a_new_one() -> None:
    async with unloaded(fail="wake_up") as it:
        manager = it.manager
        await until(lambda: manager.state is EngineState.SLEEPING)
        manager.load()
        await until(lambda: manager.state is EngineState.READY and manager.pid == 110)
        assert it.launcher.workers[0].returncode is not None  # it failed to wake: stopped
        assert it.routes.calls == [SLEEP, "POST /wake_up"]
        assert manager.sleep_counts == {"slept": 1, "wake_failed": 1} and manager.restarts == 0
        assert manager.last_exit is not None and "wake_up failed" in manager.last_exit.detail


async def test_a_failed_sleep_stops_the_worker_as_without_sleep_mode() -> None:
    async with unloaded(fail="sleep") as it:
        manager = it.manager
        await until(lambda: manager.state is EngineState.UNLOADED)
        assert it.launcher.current.returncode is not None and len(it.launcher.workers) == 1
        assert manager.sleep_counts == {"sleep_failed": 1} and manager.restarts == 0
        manager.load()
        await until(lambda: manager.state is EngineState.READY and manager.pid == 110)


async def test_a_worker_that_dies_asleep_is_a_crash_and_stays_down_until_its_load() -> None:
    async with unloaded() as it:
        manager = it.manager
        await until(lambda: manager.state is EngineState.SLEEPING)
        it.launcher.current.exit(-9)
        await until(lambda: manager.state is EngineState.UNLOADED)
        assert manager.restart_counts == {"exited": 1} and len(it.launcher.workers) == 1
        assert manager.last_exit is not None and "SIGKILL" in manager.last_exit.detail
        manager.load()
        await until(lambda: manager.state is EngineState.READY and manager.pid == 110)


# --- residency over the real managers -------------------------------------------------------

async def test_a_swap_of_sleeping_models_is_sleep_and_wake_up_not_stop_and_start() -> None:
    """Two models that do not fit together: a request for b puts a to sleep and starts b; one
    for a puts b to sleep and wakes a's first worker. A sleeping model's reservation is free."""
    async with worker_routes() as (routes_a, ask_a), worker_routes() as (routes_b, ask_b):
        launchers = {"a": FakeLauncher(), "b": FakeLauncher()}
        managers: dict[str, EngineManager] = {}
        for name, ask in (("a", ask_a), ("b", ask_b)):
            managers[name] = make_manager(launchers[name], FakeClock(),
                                          sleeper=SleepMode(ask, 5.0))
            managers[name].loaded = name == "a"
        settings = Settings(engine={"device": "cuda"}, models={
            name: {"path": f"/models/{name}", "sleep": True, "pinned": False}
            for name in managers}, residency={"min_resident_s": 0})
        entries = list(Catalog.from_settings(settings))
        plan = MemoryPlan(99, "residency.memory_bytes", {"a": 50, "b": 50})
        res = Residency([(entry, managers[entry.name]) for entry in entries], settings.residency,
                        plan=plan)
        tasks = [asyncio.create_task(manager.run()) for manager in managers.values()]
        try:
            await until(lambda: managers["a"].state is EngineState.READY)
            (await asyncio.wait_for(res.acquire("b"), 5))()
            assert managers["a"].state is EngineState.SLEEPING and routes_a.calls == [SLEEP]
            assert res.snapshot("a")["sleeping"] is True and res.snapshot("a")["loaded"] is False
            (await asyncio.wait_for(res.acquire("a"), 5))()
            assert routes_a.calls == [SLEEP, "POST /wake_up"] and routes_b.calls == [SLEEP]
            assert [len(launchers[name].workers) for name in "ab"] == [1, 1]
            assert managers["a"].pid == 100 and managers["b"].state is EngineState.SLEEPING
            registry = CollectorRegistry()
            registry.register(res.collector())
            text = generate_latest(registry).decode()
            assert value(text, "appliance_model_sleeps_total", model="a", step="woke") == 1
            assert value(text, "appliance_model_unloads_total", model="a", cause="swap") == 1
        finally:
            for manager in managers.values():
                manager.request_stop()
            await asyncio.gather(*tasks)


# --- settings -------------------------------------------------------------------------------

def test_on_a_gpu_a_sleeping_model_gets_the_flag_and_the_dev_routes_env() -> None:
    settings = Settings(engine={"device": "cuda"}, models={
        "a": {"path": "/models/a", "sleep": True}, "b": {"path": "/models/b"}})
    a, b = list(Catalog.from_settings(settings))
    assert a.sleep and not b.sleep
    on = worker_settings(a.settings(settings), sleep=a.sleep)
    off = worker_settings(b.settings(settings), sleep=b.sleep)
    assert "--enable-sleep-mode" in build_command(on)
    assert build_env(on)["VLLM_SERVER_DEV_MODE"] == "1"
    assert "--enable-sleep-mode" not in build_command(off)
    assert "VLLM_SERVER_DEV_MODE" not in build_env(off)
    assert ResidencySettings().sleep_timeout_s == 60.0


def test_on_the_cpu_sleep_is_refused_at_start_naming_the_setting() -> None:
    with pytest.raises(ValidationError, match=r"models\.b\.sleep = true needs a CUDA GPU"):
        Settings(engine={"device": "cpu"}, models={
            "a": {"path": "/models/a"}, "b": {"path": "/models/b", "sleep": True}})
    Settings(engine={"device": "cpu"}, models={"a": {"path": "/models/a"}})
