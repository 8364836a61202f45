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


Served = tuple[EngineSide, EngineReading, Callable[[], int]]  # a model's engine, reading, owed


class LoadSignals(Collector):
    """One series per model of the catalog, each labelled with its served name. For each: its
    engine, the worker's last reading, and `owed`, the requests the appliance sent to that
    worker and holds unanswered (while no worker serves, they wait). `queued`: requests waiting
    in the appliance's admission for a slot, which is the box's, not a model's: counted once,
    with the first (the default) model."""

    def __init__(self, models: list[Served], queued: Callable[[], int]) -> None:
        self._models = models
        self._queued = queued

    def collect(self) -> Iterator[Metric]:
        families = [
            GaugeMetricFamily(VllmMetric.REQUESTS_RUNNING, "Number of requests in model "
                              "execution batches.", labels=LABELS),
            GaugeMetricFamily(VllmMetric.REQUESTS_WAITING, "Number of requests waiting to be "
                              "processed (the engine's, plus those queued in the appliance).",
                              labels=LABELS),
            GaugeMetricFamily(VllmMetric.KV_CACHE_USAGE, "KV-cache usage. 1 means 100 percent "
                              "usage.", labels=LABELS),
        ]
        for index, (engine, reading, owed) in enumerate(self._models):
            queued = self._queued() if index == 0 else 0
            for family, value in zip(families, _signals(engine, reading, owed, queued),
                                     strict=True):
                family.add_metric([engine.model_name, ENGINE_INDEX], value)
        yield from families


def _signals(engine: EngineSide, reading: EngineReading, owed: Callable[[], int],
             queued: int) -> tuple[float, float, float]:
    serving = engine.state in _SERVING
    stats = reading.stats if serving else None
    running = stats.running if stats is not None else 0.0
    waiting = stats.waiting if stats is not None else 0.0
    if not serving:
        waiting = float(owed())  # held for the next worker: nothing runs them now
    kv = stats.kv_cache_usage if stats is not None else 0.0
    return running, waiting + queued, kv
