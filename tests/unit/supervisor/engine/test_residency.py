"""Residency: at most max_loaded models loaded, their reservations within the planner's
capacity; a request for another waits in its model's bounded queue while the least recently
used idle models are unloaded until it fits; idle models past
keep_alive_s are unloaded; pinned models never are. Over fake managers that change state as the
engine manager does (starting, then ready; unloaded once stopped)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from appliance.core.catalog import CatalogEntry, ResidencySettings
from appliance.core.engine import EngineState
from appliance.core.errors import EngineUnavailable, TooManyRequests
from appliance.core.sections import EngineSettings
from supervisor.engine.planner import MemoryPlan
from supervisor.engine.residency import Residency
from tests.metrics_text import value

pytestmark = pytest.mark.anyio


class FakeManager:
    """Loads in `boot_s` (starting, then ready), unloads at once."""

    def __init__(self, loaded: bool, boot_s: float = 0.01) -> None:
        self.loaded = loaded
        self.state = EngineState.READY if loaded else EngineState.UNLOADED
        self.boot_s = boot_s
        self.loads = 0
        self.sleep_counts: Counter[str] = Counter()
        self._changed = asyncio.Event()
        self._booting: asyncio.Task[None] | None = None

    def _set(self, state: EngineState) -> None:
        self.state = state
        self._changed.set()
        self._changed = asyncio.Event()

    def load(self) -> None:
        self.loaded = True
        self.loads += 1
        self._set(EngineState.STARTING)
        self._booting = asyncio.ensure_future(self._boot())

    async def _boot(self) -> None:
        await asyncio.sleep(self.boot_s)
        if self.loaded:
            self._set(EngineState.READY)

    def unload(self) -> None:
        self.loaded = False
        self._set(EngineState.UNLOADED)

    def retry_after_s(self) -> int:
        return 3

    async def changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()


def is_loaded(manager: FakeManager) -> bool:
    """Read afresh at each call (the residency under test changes it)."""
    return manager.loaded


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def entry(name: str, *, pinned: bool = False, keep_alive_s: float | None = None) -> CatalogEntry:
    return CatalogEntry(name, (), default=pinned, pinned=pinned, keep_alive_s=keep_alive_s,
                        engine=EngineSettings(model=f"/models/{name}"))


def residency(loaded: dict[str, bool], clock: Callable[[], float] | None = None,
              pinned: tuple[str, ...] = (), keep: dict[str, float] | None = None,
              plan: MemoryPlan | None = None,
              **settings: float | None) -> tuple[Residency, dict[str, FakeManager]]:
    managers = {name: FakeManager(is_loaded) for name, is_loaded in loaded.items()}
    entries = [entry(name, pinned=name in pinned, keep_alive_s=(keep or {}).get(name))
               for name in loaded]
    config = ResidencySettings(**{"max_loaded": 1, "min_resident_s": 0.0} | settings)
    return Residency(list(zip(entries, managers.values(), strict=True)), config,
                     **({"clock": clock} if clock else {}), plan=plan), managers


async def test_a_loaded_model_is_leased_at_once_without_a_load() -> None:
    res, managers = residency({"a": True, "b": False})
    release = await res.acquire("a")
    assert managers["a"].loads == 0 and res.snapshot("a")["in_use"] == 1
    release()
    release()  # twice is once
    assert res.snapshot("a")["in_use"] == 0


async def test_a_request_for_an_unloaded_model_swaps_out_the_idle_one() -> None:
    res, managers = residency({"a": True, "b": False})
    release = await res.acquire("b")
    assert managers["b"].state is EngineState.READY and is_loaded(managers["b"])
    assert not is_loaded(managers["a"]) and managers["a"].state is EngineState.UNLOADED
    assert res.snapshot("b")["swaps_in"] == 1 and res.snapshot("a")["unloads"] == {"swap": 1}
    release()
    registry = CollectorRegistry()
    registry.register(res.collector())
    text = generate_latest(registry).decode()
    assert value(text, "appliance_model_swaps_total", model="b") == 1
    assert value(text, "appliance_model_unloads_total", model="a", cause="swap") == 1
    assert value(text, "appliance_model_loaded", model="a") == 0


async def test_a_busy_model_is_drained_its_streams_end_before_it_is_unloaded() -> None:
    res, managers = residency({"a": True, "b": False})
    release_a = await res.acquire("a")
    waiting = asyncio.ensure_future(res.acquire("b"))
    await asyncio.sleep(0.1)
    assert not waiting.done() and is_loaded(managers["a"])  # a's stream is never cut
    assert res.snapshot("b")["queued"] == 1
    # Draining: a new request for a waits for a's next load instead of keeping it busy.
    late = asyncio.ensure_future(res.acquire("a"))
    await asyncio.sleep(0.1)
    assert not late.done() and res.snapshot("a")["queued"] == 1
    release_a()
    release_b = await asyncio.wait_for(waiting, 5)
    assert not is_loaded(managers["a"]) and managers["b"].state is EngineState.READY
    release_b()  # b idle: a's waiter gets a back
    (await asyncio.wait_for(late, 5))()
    assert is_loaded(managers["a"]) and not is_loaded(managers["b"])
    assert res.snapshot("a")["swaps_in"] == 1 and res.snapshot("b")["swaps_in"] == 1


async def test_requests_for_one_model_wait_together_and_share_one_load() -> None:
    res, managers = residency({"a": True, "b": False})
    releases = await asyncio.gather(*(res.acquire("b") for _ in range(5)))
    assert managers["b"].loads == 1 and res.snapshot("b")["in_use"] == 5
    for release in releases:
        release()


async def test_the_least_recently_used_idle_model_goes_first() -> None:
    clock = Clock()
    res, managers = residency({"a": True, "b": True, "c": False}, clock, max_loaded=2)
    clock.now += 1
    (await res.acquire("a"))()  # a used after b
    clock.now += 1
    (await res.acquire("c"))()
    assert is_loaded(managers["a"]) and not is_loaded(managers["b"]) and is_loaded(managers["c"])
    clock.now += 1
    release_c = await res.acquire("c")  # c busy, a idle: a goes, though used after c's load
    (await res.acquire("b"))()
    assert not is_loaded(managers["a"]) and is_loaded(managers["c"])
    release_c()


async def test_a_pinned_model_is_never_unloaded_and_a_full_queue_is_a_429() -> None:
    res, managers = residency({"a": True, "b": False}, pinned=("a",), queue_max=2,
                              load_wait_s=0.3)
    first = [asyncio.ensure_future(res.acquire("b")) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(TooManyRequests) as refused:
        await res.acquire("b")
    assert refused.value.retry_after_s is not None and refused.value.status == 429
    for waiter in first:  # no room: the load never happens, each waiter is told in time
        with pytest.raises(EngineUnavailable) as late:
            await waiter
        assert late.value.retry_after_s == 3 and "residency.load_wait_s" in late.value.message
    assert is_loaded(managers["a"]) and not is_loaded(managers["b"])


async def test_a_model_just_loaded_stays_its_minimum_time() -> None:
    clock = Clock()
    res, managers = residency({"a": True, "b": False}, clock, min_resident_s=30.0,
                              load_wait_s=0.3)
    with pytest.raises(EngineUnavailable):  # a was loaded 0 s ago: not unloaded for b yet
        await res.acquire("b")
    assert is_loaded(managers["a"])
    clock.now += 31
    (await res.acquire("b"))()
    assert not is_loaded(managers["a"]) and is_loaded(managers["b"])


async def test_an_idle_model_past_its_keep_alive_is_unloaded() -> None:
    clock = Clock()
    res, managers = residency({"a": True, "b": True}, clock, pinned=("a",),
                              keep={"a": 5.0, "b": 5.0}, max_loaded=2)
    release = await res.acquire("b")
    clock.now += 10
    await res.unload_idle()
    assert is_loaded(managers["b"])  # in use: not idle, however long ago it began
    release()
    clock.now += 4
    await res.unload_idle()
    assert is_loaded(managers["b"])  # idle 4 s of its 5
    clock.now += 2
    await res.unload_idle()
    assert not is_loaded(managers["b"]) and res.snapshot("b")["unloads"] == {"idle": 1}
    assert is_loaded(managers["a"])  # pinned
    (await res.acquire("b"))()  # the next request loads it again, no swap needed
    assert is_loaded(managers["b"]) and res.snapshot("b")["swaps_in"] == 0


async def test_a_crashed_model_is_a_503_not_a_wait() -> None:
    res, managers = residency({"a": True, "b": False})
    managers["a"].state = EngineState.BACKOFF
    with pytest.raises(EngineUnavailable) as refused:
        await res.acquire("a")
    assert refused.value.retry_after_s == 3 and "backoff" in refused.value.message


def test_the_pinned_models_then_the_catalogs_order_are_loaded_at_start() -> None:
    entries = [entry("a"), entry("b", pinned=True), entry("c")]
    assert Residency.initially_loaded(entries, ResidencySettings(max_loaded=2)) == {"b", "a"}
    assert Residency.initially_loaded(entries, ResidencySettings()) == {"a", "b", "c"}


async def test_waiters_of_a_model_loaded_meanwhile_are_not_stuck_behind_another_swap() -> None:
    """a busy; b asked (a drains); a asked again (it waits for a's next load); b asked again
    while the first swap runs. b's second waiter must not wait behind a's, which can only
    unload b once b's waiters are served."""
    res, managers = residency({"a": True, "b": False}, load_wait_s=3.0)
    managers["b"].boot_s = 0.2
    release_a = await res.acquire("a")
    first_b = asyncio.ensure_future(res.acquire("b"))
    await asyncio.sleep(0.05)
    again_a = asyncio.ensure_future(res.acquire("a"))
    await asyncio.sleep(0.05)
    second_b = asyncio.ensure_future(res.acquire("b"))
    await asyncio.sleep(0.05)
    release_a()
    releases = await asyncio.wait_for(asyncio.gather(first_b, second_b), 2.5)
    assert managers["b"].loads == 1 and not again_a.done()
    for release in releases:
        release()
    (await asyncio.wait_for(again_a, 2.5))()
    assert is_loaded(managers["a"]) and not is_loaded(managers["b"])


def sized(capacity: int, **reservations: int) -> MemoryPlan:
    return MemoryPlan(capacity, "residency.memory_bytes", reservations)


async def test_a_model_that_does_not_fit_beside_the_loaded_one_swaps_it_out() -> None:
    """No max_loaded: the capacity, just under the two reservations' sum, is the limit."""
    res, managers = residency({"a": True, "b": False}, plan=sized(99, a=50, b=50),
                              max_loaded=None)
    (await res.acquire("b"))()
    assert not is_loaded(managers["a"]) and is_loaded(managers["b"])
    assert res.snapshot("b")["swaps_in"] == 1 and res.snapshot("a")["unloads"] == {"swap": 1}
    assert res.snapshot("b")["reserved_bytes"] == 50


async def test_a_model_that_fits_beside_the_loaded_ones_is_loaded_without_a_swap() -> None:
    res, managers = residency({"a": True, "b": False}, plan=sized(100, a=50, b=50),
                              max_loaded=None)
    (await res.acquire("b"))()
    assert is_loaded(managers["a"]) and is_loaded(managers["b"])
    assert res.snapshot("b")["swaps_in"] == 0


async def test_a_big_model_unloads_the_least_recently_used_until_it_fits() -> None:
    clock = Clock()
    res, managers = residency({"a": True, "b": True, "c": True, "big": False}, clock,
                              plan=sized(100, a=30, b=30, c=30, big=60), max_loaded=None)
    for name in ("c", "a", "b"):  # c least recently used, then a
        clock.now += 1
        (await res.acquire(name))()
    (await res.acquire("big"))()
    assert [name for name, m in managers.items() if is_loaded(m)] == ["b", "big"]
    registry = CollectorRegistry()
    registry.register(res.collector())
    text = generate_latest(registry).decode()
    assert value(text, "appliance_model_reserved_bytes", model="big") == 60
    assert value(text, "appliance_residency_capacity_bytes") == 100


async def test_max_loaded_still_caps_models_that_would_fit() -> None:
    res, managers = residency({"a": True, "b": False}, plan=sized(100, a=10, b=10),
                              max_loaded=1)
    (await res.acquire("b"))()
    assert not is_loaded(managers["a"]) and is_loaded(managers["b"])


async def test_nothing_is_drained_while_not_enough_can_go_and_the_wait_is_bounded() -> None:
    """big needs a and b gone; b was loaded too recently: a must stay loaded (draining it
    would free nothing big can use), and big's request gets a 503 in time, not a hang."""
    clock = Clock()
    res, managers = residency({"a": True, "b": False, "big": False}, clock,
                              plan=sized(100, a=40, b=40, big=70), max_loaded=None,
                              min_resident_s=30.0, load_wait_s=0.3)
    clock.now += 31
    (await res.acquire("b"))()  # b loaded now, beside a
    with pytest.raises(EngineUnavailable) as late:
        await res.acquire("big")
    assert late.value.retry_after_s == 3
    assert is_loaded(managers["a"]) and is_loaded(managers["b"]) and not is_loaded(managers["big"])
    assert res.snapshot("a")["unloads"] == {}


def test_at_start_the_pinned_models_then_those_that_fit_in_order_are_loaded() -> None:
    entries = [entry("a"), entry("b", pinned=True), entry("c"), entry("d")]
    plan = sized(100, a=60, b=30, c=50, d=20)
    assert Residency.initially_loaded(entries, ResidencySettings(), plan) == {"b", "a"}
    assert Residency.initially_loaded(entries, ResidencySettings(max_loaded=2),
                                      sized(100, a=80, b=30, c=50, d=20)) == {"b", "c"}
