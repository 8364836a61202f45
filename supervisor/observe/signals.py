"""The load signals routers read, in vLLM's own names, labels and meaning, read at scrape time.

vllm-router, llm-d's endpoint picker and production-stack balance vLLM servers on
`vllm:num_requests_running`, `vllm:num_requests_waiting` and `vllm:kv_cache_usage_perc`, labelled
`model_name` (the served name) and `engine` (the engine core's index), as vLLM 0.32's
vllm/v1/metrics/loggers.py declares them. A box in front of its worker holds work the worker's
own gauges never see: requests queued in the appliance's admission, and requests held for a
worker that is restarting (they resume on the next one). Both are waiting, so they are added to
the worker's waiting count, never hidden: a router that reads "0 waiting" from a box with a full
queue would send it more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Protocol

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from appliance.core.engine import EngineState
from appliance.fences.vllm import Metric as VllmMetric
from supervisor.engine.stats import EngineStats

LABELS = ["model_name", "engine"]
ENGINE_INDEX = "0"  # one engine core per worker (no data parallelism inside a box)
# A worker in these states runs the requests it holds; its last reading still describes them.
_SERVING = frozenset({EngineState.READY, EngineState.DRAINING})


class EngineSide(Protocol):
    @property
    def state(self) -> EngineState: ...

    @property
    def model_name(self) -> str: ...


class EngineReading(Protocol):
    stats: EngineStats | None


class LoadSignals(Collector):
    """`queued`: requests waiting in the appliance's admission for a slot. `owed`: requests the
    appliance sent to the worker and holds unanswered (while no worker serves, they wait)."""

    def __init__(self, engine: EngineSide, reading: EngineReading,
                 queued: Callable[[], int], owed: Callable[[], int]) -> None:
        self._engine = engine
        self._reading = reading
        self._queued = queued
        self._owed = owed

    def collect(self) -> Iterator[Metric]:
        serving = self._engine.state in _SERVING
        stats = self._reading.stats if serving else None
        running = stats.running if stats is not None else 0.0
        waiting = stats.waiting if stats is not None else 0.0
        if not serving:
            waiting = float(self._owed())  # held for the next worker: nothing runs them now
        waiting += self._queued()
        kv = stats.kv_cache_usage if stats is not None else 0.0
        labels = [self._engine.model_name, ENGINE_INDEX]
        yield _gauge(VllmMetric.REQUESTS_RUNNING, "Number of requests in model execution "
                     "batches.", labels, running)
        yield _gauge(VllmMetric.REQUESTS_WAITING, "Number of requests waiting to be processed "
                     "(the engine's, plus those queued in the appliance).", labels, waiting)
        yield _gauge(VllmMetric.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent usage.",
                     labels, kv)


def _gauge(name: str, documentation: str, labels: list[str], value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, documentation, labels=LABELS)
    family.add_metric(labels, value)
    return family
