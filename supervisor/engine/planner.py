"""The reservation planner: which models of the catalog fit in memory together.

Each model has a reservation, and the models loaded at once must keep the sum of theirs within
a capacity. On a GPU a model's reservation is what gpu_budget sizes for it (its
gpu_memory_utilization share, or the sized reservation capped by gpu_memory_max_share, times
the card's total memory as NVML reads it), plus the CUDA context its worker creates before vLLM
measures its share (vLLM counts its budget from that point: vllm/utils/mem_utils.py, read from
source); the capacity is the card's total memory. On the CPU it is the worker's KV cache
(kv_cache_memory_bytes, or VLLM_CPU_KVCACHE_SPACE where the worker's environment sets it) plus
its weights' size on disk; the capacity is the host memory available at start. Either way
`residency.memory_bytes` sets the capacity instead.

Start-up refuses (PlanError) a catalog with a model that can never be loaded: its reservation
alone over the capacity, or over it beside the pinned models (which are never unloaded).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import psutil
import structlog

from appliance.core.catalog import Catalog, CatalogEntry, ResidencySettings
from appliance.core.sections import EngineSettings, GpuSettings
from supervisor.engine.gpu_budget import (
    CONTEXT_HEADROOM_BYTES,
    GIB,
    GpuMemory,
    Reservation,
    read_gpu_memory,
    weights_bytes,
)
from supervisor.engine.worker import cpu_kv_cache_bytes

log = structlog.get_logger("supervisor.engine.planner")


class PlanError(Exception):
    """A model of the catalog can never be loaded within the capacity: a configuration error."""


@dataclass(frozen=True)
class MemoryPlan:
    """Each model's reservation and the capacity the loaded models' reservations share."""

    capacity_bytes: int
    capacity_from: str  # what set the capacity, as the refusals name it
    reservations: Mapping[str, int]

    def reserved(self, names: Iterable[str]) -> int:
        return sum(self.reservations[name] for name in names)

    def fits(self, names: Iterable[str]) -> bool:
        """Whether these models' reservations fit in the capacity together."""
        return self.reserved(names) <= self.capacity_bytes

    def check(self, entries: Iterable[CatalogEntry]) -> None:
        """Raise PlanError, naming the model and the numbers, where one can never be loaded."""
        entries = list(entries)
        pinned = [entry.name for entry in entries if entry.pinned]
        capacity = f"{_gib(self.capacity_bytes)} ({self.capacity_from})"
        for entry in entries:
            alone = self.reservations[entry.name]
            if alone > self.capacity_bytes:
                raise PlanError(f"models.{entry.name} reserves {_gib(alone)}, more than the "
                                f"capacity of {capacity}: it can never be loaded; lower its "
                                "reservation (kv_cache_memory_bytes on the CPU, "
                                "gpu_memory_max_share on a GPU) or raise residency.memory_bytes")
            beside = sorted(set(pinned) | {entry.name})
            if not self.fits(beside):
                raise PlanError(f"models {', '.join(beside)} reserve "
                                f"{_gib(self.reserved(beside))} together, more than the "
                                f"capacity of {capacity}, and pinned models are never unloaded: "
                                "set pinned = false on one, lower a reservation, or raise "
                                "residency.memory_bytes")


def plan_memory(catalog: Catalog, residency: ResidencySettings, gpu: GpuSettings,
                gpu_reservations: Mapping[str, Reservation | None], *,
                read_memory: Callable[[GpuSettings], GpuMemory | None] = read_gpu_memory,
                host_available: Callable[[], int] = lambda: psutil.virtual_memory().available,
                ) -> MemoryPlan | None:
    """The plan for the catalog's models; None on a GPU whose memory NVML cannot read (then
    residency.max_loaded alone limits the models loaded at once). gpu_reservations: what
    gpu_budget sized for each model (None where it could not, or on the CPU)."""
    if catalog.default.engine.resolved_device() != "cuda":
        capacity, source = _capacity(residency, host_available(),
                                     "the host memory available at start")
        reservations = {entry.name: _cpu_reservation(entry.engine) for entry in catalog}
    else:
        total = next((r.total_bytes for r in gpu_reservations.values() if r is not None), None)
        if total is None and (memory := read_memory(gpu)) is not None:
            total = memory.total_bytes
        if total is None:
            log.warning("residency.unplanned", error="NVML gave no memory reading",
                        hint="residency.max_loaded alone limits the models loaded at once")
            return None
        capacity, source = _capacity(residency, total, "the GPU's total memory")
        reservations = {entry.name: _gpu_reservation(entry, gpu_reservations.get(entry.name),
                                                     total, capacity) for entry in catalog}
    plan = MemoryPlan(capacity, source, reservations)
    log.info("residency.plan", capacity_bytes=capacity, capacity_from=source,
             reservations=dict(reservations), all_fit=plan.fits(reservations))
    return plan


def _capacity(residency: ResidencySettings, measured: int, source: str) -> tuple[int, str]:
    if residency.memory_bytes is not None:
        return residency.memory_bytes, "residency.memory_bytes"
    return measured, source


def _cpu_reservation(engine: EngineSettings) -> int:
    return cpu_kv_cache_bytes(engine) + weights_bytes(Path(engine.model))


def _gpu_reservation(entry: CatalogEntry, sized: Reservation | None, total: int,
                     capacity: int) -> int:
    """The sized share; where gpu_budget could not size it, the operator's
    gpu_memory_utilization, else the whole capacity (vLLM's own default share then applies, so
    the model is planned to load alone)."""
    if sized is not None:
        share = sized.reserved_bytes
    elif entry.engine.gpu_memory_utilization is not None:
        share = math.floor(entry.engine.gpu_memory_utilization * total)
    else:
        log.warning("residency.reservation_unsized", model=entry.name,
                    hint=f"set models.{entry.name}.gpu_memory_utilization")
        return capacity
    return share + CONTEXT_HEADROOM_BYTES


def _gib(value: int) -> str:
    return f"{value / GIB:.2f} GiB"
