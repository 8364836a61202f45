"""Supervisor facts for Prometheus, read at scrape time: engine state, restarts, transitions,
the worker's own gauges, the GPU. Nothing is copied or pushed; `collect()` asks the owners."""

from __future__ import annotations

from collections.abc import Iterator
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


class SupervisorCollector(Collector):
    def __init__(self, manager: EngineManager, engine: EngineGauges,
                 gpu: GpuGauges | None, canary: CanaryVerdict | None = None) -> None:
        self._manager = manager
        self._engine = engine
        self._gpu = gpu
        self._canary = canary

    def collect(self) -> Iterator[Metric]:
        manager = self._manager
        state = GaugeMetricFamily("appliance_engine_state", "1 for the engine's current state.",
                                  labels=["state"])
        for each in EngineState:
            state.add_metric([each.value], 1.0 if manager.state is each else 0.0)
        yield state
        yield _counter("appliance_engine_restarts", "Worker restarts, by cause.", "cause",
                       manager.restart_counts)
        yield _counter("appliance_engine_transitions", "Engine state transitions, by target.",
                       "to", manager.transition_counts)
        stats = self._engine.stats if manager.state is EngineState.READY else None
        if stats is not None:
            yield GaugeMetricFamily("appliance_engine_requests_running",
                                    "The worker's vllm:num_requests_running.", value=stats.running)
            yield GaugeMetricFamily("appliance_engine_requests_waiting",
                                    "The worker's vllm:num_requests_waiting.", value=stats.waiting)
            yield GaugeMetricFamily("appliance_engine_kv_cache_usage_ratio",
                                    "The worker's vllm:kv_cache_usage_perc.",
                                    value=stats.kv_cache_usage)
        verdict = self._canary.result if self._canary is not None else None
        if verdict is not None and verdict.ok is not None:  # absent until a worker is judged
            yield GaugeMetricFamily("appliance_canary_ok", "1 while the last worker judged gave "
                                    "the recorded greedy answers, 0 on a mismatch.",
                                    value=1.0 if verdict.ok else 0.0)
        for name, value in (self._gpu.gauges() if self._gpu is not None else {}).items():
            if name in _COUNTERS:
                yield CounterMetricFamily(f"appliance_{name.removesuffix('_total')}",
                                          f"NVML: {name}.", value=value)
            else:
                yield GaugeMetricFamily(f"appliance_{name}", f"NVML: {name}.", value=value)


def _counter(name: str, documentation: str, label: str,
             counts: dict[str, int]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, documentation, labels=[label])
    for key, count in sorted(counts.items()):
        family.add_metric([key], float(count))
    return family


def restart_durations(registry: CollectorRegistry) -> Histogram:
    """appliance_restart_duration_seconds{phase}: stop, backoff, boot, total."""
    return Histogram("appliance_restart_duration_seconds",
                     "Duration of each phase of a worker restart (detected to ready).", ["phase"],
                     buckets=LATENCY_BUCKETS, registry=registry)
