"""Supervisor facts for Prometheus, read at scrape time: engine state, restarts, transitions,
the worker's own gauges and the canary's verdict, each labelled with its model; the GPU's
readings, the box's. Nothing is copied or pushed; `collect()` asks the owners."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.core.engine import EngineState
from appliance.core.latency import LATENCY_BUCKETS
from supervisor.engine.manager import EngineManager
from supervisor.engine.stats import EngineStats
from supervisor.selftest.canary import CanaryResult

_COUNTERS = frozenset({"gpu_xid_events_total"})  # GPU readings that only ever grow


class EngineGauges(Protocol):
    stats: EngineStats | None


class GpuGauges(Protocol):
    def gauges(self) -> dict[str, float]: ...


class CanaryVerdict(Protocol):
    result: CanaryResult | None


@dataclass(frozen=True)
class ObservedModel:
    """One model's supervision, as the collector reads it."""

    name: str
    manager: EngineManager
    engine: EngineGauges
    canary: CanaryVerdict | None = None


class SupervisorCollector(Collector):
    def __init__(self, models: list[ObservedModel], gpu: GpuGauges | None) -> None:
        self._models = models
        self._gpu = gpu

    def collect(self) -> Iterator[Metric]:
        state = GaugeMetricFamily("appliance_engine_state", "1 for the engine's current state.",
                                  labels=["model", "state"])
        restarts = CounterMetricFamily("appliance_engine_restarts", "Worker restarts, by cause.",
                                       labels=["model", "cause"])
        transitions = CounterMetricFamily("appliance_engine_transitions",
                                          "Engine state transitions, by target.",
                                          labels=["model", "to"])
        running, waiting, kv, canary = (
            GaugeMetricFamily("appliance_engine_requests_running",
                              "The worker's vllm:num_requests_running.", labels=["model"]),
            GaugeMetricFamily("appliance_engine_requests_waiting",
                              "The worker's vllm:num_requests_waiting.", labels=["model"]),
            GaugeMetricFamily("appliance_engine_kv_cache_usage_ratio",
                              "The worker's vllm:kv_cache_usage_perc.", labels=["model"]),
            GaugeMetricFamily("appliance_canary_ok", "1 while the last worker judged gave the "
                              "recorded greedy answers, 0 on a mismatch.", labels=["model"]))
        for model in self._models:
            manager, labels = model.manager, [model.name]
            for each in EngineState:
                state.add_metric([model.name, each.value], 1.0 if manager.state is each else 0.0)
            _count(restarts, labels, manager.restart_counts)
            _count(transitions, labels, manager.transition_counts)
            stats = model.engine.stats if manager.state is EngineState.READY else None
            if stats is not None:  # no worker: no stale readings
                running.add_metric(labels, stats.running)
                waiting.add_metric(labels, stats.waiting)
                kv.add_metric(labels, stats.kv_cache_usage)
            verdict = model.canary.result if model.canary is not None else None
            if verdict is not None and verdict.ok is not None:  # absent until a worker is judged
                canary.add_metric(labels, 1.0 if verdict.ok else 0.0)
        yield from (state, restarts, transitions)  # always: an alert reads them from the start
        # The worker's readings only while some worker serves; the verdict once one is judged.
        yield from (family for family in (running, waiting, kv, canary) if family.samples)
        for name, value in (self._gpu.gauges() if self._gpu is not None else {}).items():
            if name in _COUNTERS:
                yield CounterMetricFamily(f"appliance_{name.removesuffix('_total')}",
                                          f"NVML: {name}.", value=value)
            else:
                yield GaugeMetricFamily(f"appliance_{name}", f"NVML: {name}.", value=value)


def _count(family: CounterMetricFamily, labels: list[str], counts: dict[str, int]) -> None:
    for key, count in sorted(counts.items()):
        family.add_metric([*labels, key], float(count))


def restart_durations(registry: CollectorRegistry) -> Histogram:
    """appliance_restart_duration_seconds{phase, model}: stop, backoff, boot, total."""
    return Histogram("appliance_restart_duration_seconds",
                     "Duration of each phase of a worker restart (detected to ready).",
                     ["phase", "model"],
                     buckets=LATENCY_BUCKETS, registry=registry)
