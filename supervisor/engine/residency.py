"""Residency: which models of the catalog have a worker loaded, and the swaps between them.

The loaded models' reservations fit in the planner's capacity (supervisor.engine.planner), and
at most `residency.max_loaded` models are loaded at once. A request for a model that is not
loaded takes a place in that model's bounded queue and waits while the least recently used
models are drained and unloaded until it fits, and the requested one starts from its worker
template. An idle model (nothing in flight, nothing waiting) goes before a busy one; a busy
one is drained: its new requests wait for its next load while those in flight finish (no
stream is cut). None loaded less than `min_resident_s` ago is chosen (no thrash), so
requests for one model wait together and are served together by its one load. A full queue
is a 429, a load not done within `load_wait_s` a 503, both with Retry-After: never a hang. A
model idle past its `keep_alive_s` is unloaded. Pinned models are never unloaded. A model
with sleep mode (models.<name>.sleep) is put to sleep instead of stopped, and woken instead of
started (supervisor.engine.resting); asleep, it is not loaded and reserves nothing here.

The API holds a lease on its model for each request's whole life (appliance.core.engine's
Residency); a lease is what makes a model busy here.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.core.catalog import CatalogEntry, ResidencySettings
from appliance.core.engine import EngineState
from appliance.core.errors import EngineUnavailable, TooManyRequests
from supervisor.engine.planner import MemoryPlan

log = structlog.get_logger("supervisor.engine.residency")

# A worker in these states is a fault being handled (restart, crash loop), not a swap: its
# requests are told to come back, as with one model.
_FAULTS = frozenset({EngineState.BACKOFF, EngineState.FAILED, EngineState.UNHEALTHY})
# An unloaded model's worker is down in these: stopped, or asleep (models.<name>.sleep).
_AWAY = frozenset({EngineState.UNLOADED, EngineState.SLEEPING})


class Loadable(Protocol):
    """The engine manager as residency drives it."""

    @property
    def state(self) -> EngineState: ...

    @property
    def loaded(self) -> bool: ...

    def load(self) -> None: ...

    def unload(self) -> None: ...

    def retry_after_s(self) -> int: ...

    @property
    def sleep_counts(self) -> Counter[str]: ...

    async def changed(self, timeout_s: float) -> None: ...


@dataclass
class _Slot:
    entry: CatalogEntry
    manager: Loadable
    leases: int = 0  # requests holding the model (in flight, from admission to their end)
    queued: int = 0  # requests waiting for it to be loaded
    last_used: float = 0.0
    loaded_at: float = 0.0
    leaving: bool = False  # being unloaded: new requests wait for its next load
    unloads: Counter[str] = field(default_factory=Counter)
    swaps: int = 0  # loads that needed another model unloaded first

    @property
    def serving(self) -> bool:
        return self.manager.loaded and not self.leaving \
            and self.manager.state is EngineState.READY


class Residency:
    """Keeps the loaded models within the plan's capacity and max_loaded; the API's
    Residency. plan: None where no capacity is known (max_loaded alone limits them)."""

    def __init__(self, models: list[tuple[CatalogEntry, Loadable]], settings: ResidencySettings,
                 clock: Callable[[], float] = time.monotonic, plan: MemoryPlan | None = None,
                 ) -> None:
        self._settings = settings
        self._plan = plan
        self._clock = clock
        now = clock()
        self._slots = {entry.name: _Slot(entry, manager, last_used=now, loaded_at=now)
                       for entry, manager in models}
        self._swap = asyncio.Lock()  # one load (and the unloads it needs) at a time
        self._released = asyncio.Event()  # a lease ended: a model may have become idle

    @staticmethod
    def initially_loaded(entries: list[CatalogEntry], settings: ResidencySettings,
                         plan: MemoryPlan | None = None) -> set[str]:
        """The models loaded at start: the pinned ones, then each in the catalog's order that
        fits beside those before it, up to max_loaded (every one without a limit)."""
        most = settings.max_loaded or len(entries)
        loaded = [entry.name for entry in entries if entry.pinned]
        for entry in entries:
            if not entry.pinned and len(loaded) < most \
                    and (plan is None or plan.fits([*loaded, entry.name])):
                loaded.append(entry.name)
        return set(loaded)

    # --- the API's side ---------------------------------------------------------------------

    async def acquire(self, model: str) -> Callable[[], None]:
        """Wait until `model`'s worker serves, loading it (and unloading another) if need be;
        returns the release the request calls at its end."""
        slot = self._slots[model]
        if not slot.serving:
            await self._wait_loaded(slot)
        slot.leases += 1
        slot.last_used = self._clock()
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                slot.leases -= 1
                slot.last_used = self._clock()
                self._released.set()
                self._released = asyncio.Event()

        return release

    async def _wait_loaded(self, slot: _Slot) -> None:
        manager, settings = slot.manager, self._settings
        if manager.loaded and not slot.leaving and manager.state in _FAULTS:
            raise _unavailable(slot, f"the engine of model '{slot.entry.name}' is "
                                     f"{manager.state.value}; retry shortly")
        if slot.queued >= settings.queue_max:
            raise TooManyRequests(
                f"{slot.queued} requests already wait for model '{slot.entry.name}' to be "
                "loaded (setting residency.queue_max); retry shortly", code="model_queue_full",
                retry_after_s=max(1, round(settings.load_wait_s / 4)), reason="model_queue_full")
        slot.queued += 1
        try:
            async with asyncio.timeout(settings.load_wait_s):
                while not slot.serving:
                    if not manager.loaded or slot.leaving:
                        await self._bring_in(slot)
                    elif manager.state in _FAULTS:
                        raise _unavailable(slot, f"model '{slot.entry.name}' failed to load "
                                                 f"({manager.state.value}); retry shortly")
                    await manager.changed(1.0)
        except TimeoutError:
            raise _unavailable(slot, f"model '{slot.entry.name}' was not loaded within "
                                     f"{settings.load_wait_s:g}s (setting residency.load_wait_s); "
                                     "retry shortly") from None
        finally:
            slot.queued -= 1

    # --- swaps ------------------------------------------------------------------------------

    async def _bring_in(self, slot: _Slot) -> None:
        """Load `slot`'s model, first draining and unloading the models `_victims` names to
        make room. The lock is held only for a swap itself: while not enough models can go
        yet (each loaded too recently, or being loaded for its own waiters), the waiter lets
        go of it and tries again when a request ends or a second passes, so that the waiters
        of a model loaded meanwhile are never stuck behind it."""
        while True:
            async with self._swap:
                if slot.manager.loaded and not slot.leaving:
                    return  # another waiter of this model loaded it meanwhile
                victims = self._victims(slot)
                if victims is not None:
                    for victim in victims:
                        await self._unload(victim, "swap")
                    slot.loaded_at = self._clock()
                    slot.swaps += bool(victims)
                    log.info("model.loading", model=slot.entry.name, swap=bool(victims),
                             unloaded=[victim.entry.name for victim in victims],
                             waiting=slot.queued)
                    slot.manager.load()
                    return
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await self._released.wait()  # or time passes (min_resident_s)

    def _room(self, slot: _Slot, going: list[_Slot]) -> bool:
        """Whether `slot`'s model may be loaded once the `going` models are unloaded: within
        max_loaded, and its reservation fits beside those that stay."""
        staying = [other.entry.name for other in self._slots.values()
                   if other.manager.loaded and other not in going]
        if len(staying) >= (self._settings.max_loaded or len(self._slots)):
            return False
        return self._plan is None or self._plan.fits([*staying, slot.entry.name])

    def _victims(self, slot: _Slot) -> list[_Slot] | None:
        """The models to unload for `slot`'s: the fewest, in the order `_candidates` gives,
        that make room (none where there is room already); None where those that may go now
        do not make enough (nothing is drained for a load that could not happen yet)."""
        going: list[_Slot] = []
        for candidate in self._candidates():
            if self._room(slot, going):
                break
            going.append(candidate)
        return going if self._room(slot, going) else None

    def _idle(self, slot: _Slot) -> bool:
        return slot.manager.loaded and not slot.entry.pinned and not slot.leaving \
            and slot.leases == 0 and slot.queued == 0

    def _candidates(self) -> list[_Slot]:
        """The models that may be unloaded, in the order they go: among those loaded at least
        min_resident_s ago, not pinned and with no request waiting for their load to finish,
        the idle ones before the busy ones, the least recently used first."""
        now = self._clock()
        loaded = [slot for slot in self._slots.values()
                  if slot.manager.loaded and not slot.entry.pinned and not slot.leaving
                  and slot.queued == 0 and now - slot.loaded_at >= self._settings.min_resident_s]
        return sorted(loaded, key=lambda slot: (not self._idle(slot), slot.last_used))

    async def _unload(self, slot: _Slot, cause: str) -> None:
        """Drain `slot`'s model (its new requests wait for its next load; those in flight
        finish), then stop its worker, or put it to sleep, and wait until it is down."""
        slot.leaving = True
        log.info("model.unloading", model=slot.entry.name, cause=cause, in_flight=slot.leases,
                 idle_s=round(self._clock() - slot.last_used, 1))
        try:
            while slot.leases > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(1.0):
                        await self._released.wait()
            slot.manager.unload()
            while slot.manager.state not in _AWAY:
                await slot.manager.changed(1.0)
        finally:
            slot.leaving = False
        slot.unloads[cause] += 1

    # --- idle models --------------------------------------------------------------------------

    async def run(self) -> None:
        """Unload each model idle past its keep_alive_s, until cancelled."""
        while True:
            await asyncio.sleep(self._settings.idle_check_s)
            await self.unload_idle()

    async def unload_idle(self) -> None:
        now = self._clock()
        for slot in self._slots.values():
            keep = slot.entry.keep_alive_s
            if keep is not None and self._idle(slot) and now - slot.last_used >= keep:
                async with self._swap:
                    if self._idle(slot):  # a request may have come while the lock was taken
                        await self._unload(slot, "idle")

    # --- facts --------------------------------------------------------------------------------

    def snapshot(self, model: str) -> dict[str, object]:
        slot = self._slots[model]
        return {"loaded": slot.manager.loaded, "in_use": slot.leases, "queued": slot.queued,
                "sleeping": slot.manager.state is EngineState.SLEEPING,
                "sleeps": dict(slot.manager.sleep_counts),
                "idle_s": round(self._clock() - slot.last_used, 1), "swaps_in": slot.swaps,
                "unloads": dict(slot.unloads)} | (
                    {} if self._plan is None
                    else {"reserved_bytes": self._plan.reservations[model]})

    def collector(self) -> Collector:
        return _ResidencyCollector(self._slots, self._plan)


def _unavailable(slot: _Slot, message: str) -> EngineUnavailable:
    return EngineUnavailable(message, code="engine_unavailable",
                             retry_after_s=slot.manager.retry_after_s(),
                             reason="engine_unavailable")


class _ResidencyCollector(Collector):
    """appliance_model_* series, read at scrape time."""

    def __init__(self, slots: dict[str, _Slot], plan: MemoryPlan | None) -> None:
        self._slots = slots
        self._plan = plan

    def collect(self) -> Iterator[Metric]:
        loaded = GaugeMetricFamily("appliance_model_loaded", "1 while residency keeps the "
                                   "model's worker loaded.", labels=["model"])
        queued = GaugeMetricFamily("appliance_model_load_queue", "Requests waiting for the "
                                   "model to be loaded.", labels=["model"])
        swaps = CounterMetricFamily("appliance_model_swaps", "Loads of the model that unloaded "
                                    "another model first.", labels=["model"])
        unloads = CounterMetricFamily("appliance_model_unloads", "Unloads of the model, by "
                                      "cause (swap: another's turn; idle: keep_alive_s).",
                                      labels=["model", "cause"])
        sleeps = CounterMetricFamily("appliance_model_sleeps", "Sleep-mode steps of the "
                                     "model's worker (slept, woke; sleep_failed: stopped "
                                     "instead; wake_failed: restarted instead).",
                                     labels=["model", "step"])
        for name, slot in self._slots.items():
            loaded.add_metric([name], float(slot.manager.loaded))
            for step in ("slept", "woke", "sleep_failed", "wake_failed"):
                sleeps.add_metric([name, step], float(slot.manager.sleep_counts[step]))
            queued.add_metric([name], float(slot.queued))
            swaps.add_metric([name], float(slot.swaps))
            for cause in ("swap", "idle"):
                unloads.add_metric([name, cause], float(slot.unloads[cause]))
        yield from (loaded, queued, swaps, unloads, sleeps)
        if self._plan is not None:
            reserved = GaugeMetricFamily("appliance_model_reserved_bytes", "The model's "
                                         "reservation, as the planner counts it.",
                                         labels=["model"])
            for name, size in self._plan.reservations.items():
                reserved.add_metric([name], float(size))
            yield reserved
            yield GaugeMetricFamily("appliance_residency_capacity_bytes", "The memory the "
                                    "loaded models' reservations share.",
                                    value=float(self._plan.capacity_bytes))
