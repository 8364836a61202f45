"""The load signals a router reads: vLLM's names, labels and meaning on the appliance's /metrics,
read at scrape time, with the appliance's own queue folded into the waiting count."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from appliance.core.engine import EngineState
from supervisor.engine.stats import EngineStats, parse_engine_stats
from supervisor.observe.signals import LoadSignals
from tests.metrics_text import samples, value

# What vLLM 0.32 declares for these three (vllm/v1/metrics/loggers.py): gauges labelled
# model_name (the served name) and engine (the engine core's index).
VLLM_NAMES = {"vllm:num_requests_running", "vllm:num_requests_waiting",
              "vllm:kv_cache_usage_perc"}


@dataclass
class FakeEngine:
    state: EngineState = EngineState.READY
    model_name: str = "smollm2"


@dataclass
class FakeReading:
    stats: EngineStats | None = None


@dataclass
class Counts:
    queued: int = 0
    owed: int = 0


def scrape(engine: FakeEngine, reading: FakeReading, counts: Counts) -> str:
    registry = CollectorRegistry()
    registry.register(LoadSignals([(engine, reading, lambda: counts.owed)], lambda: counts.queued))
    return generate_latest(registry).decode()


def test_the_names_types_and_labels_are_vllms() -> None:
    text = scrape(FakeEngine(), FakeReading(EngineStats(running=2, waiting=1)), Counts())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert set(families) == VLLM_NAMES
    for family in families.values():
        assert family.type == "gauge"
        assert [s.labels for s in family.samples] == [{"model_name": "smollm2", "engine": "0"}]


def test_a_router_reads_what_the_engine_runs_and_everything_that_waits() -> None:
    engine, reading = FakeEngine(), FakeReading(EngineStats(running=3, waiting=2,
                                                            kv_cache_usage=0.4))
    counts = Counts(queued=5, owed=5)  # owed: the engine's five, already in its gauges
    text = scrape(engine, reading, counts)
    assert value(text, "vllm:num_requests_running") == 3
    assert value(text, "vllm:num_requests_waiting") == 2 + 5  # the engine's, then admission's
    assert value(text, "vllm:kv_cache_usage_perc") == 0.4
    # The page reads back through the parser the supervisor uses on vLLM's own page.
    assert parse_engine_stats(text) == EngineStats(running=3, waiting=7, kv_cache_usage=0.4)


def test_read_at_scrape_time_not_copied() -> None:
    reading, counts = FakeReading(EngineStats(running=1)), Counts()
    engine = FakeEngine()
    first = scrape(engine, reading, counts)
    reading.stats, counts.queued = EngineStats(running=4, waiting=1), 2
    second = scrape(engine, reading, counts)
    assert value(first, "vllm:num_requests_waiting") == 0
    assert (value(second, "vllm:num_requests_running"),
            value(second, "vllm:num_requests_waiting")) == (4, 3)


def test_a_draining_box_still_reports_the_work_it_runs() -> None:
    text = scrape(FakeEngine(EngineState.DRAINING), FakeReading(EngineStats(running=2)), Counts())
    assert value(text, "vllm:num_requests_running") == 2


def test_no_worker_serving_nothing_runs_and_what_it_holds_waits() -> None:
    """A restarting worker's last reading is stale: the requests held for the next worker
    wait, none runs, no KV cache is in use."""
    stale = FakeReading(EngineStats(running=6, waiting=0, kv_cache_usage=0.9))
    text = scrape(FakeEngine(EngineState.BACKOFF), stale, Counts(queued=1, owed=4))
    assert {name: v for (name, _), v in samples(text).items()} == {
        "vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 5.0,
        "vllm:kv_cache_usage_perc": 0.0}


def test_each_model_is_a_series_and_the_admission_queue_is_counted_once() -> None:
    """Two models: each its served name's series; the box's queue only with the default."""
    registry = CollectorRegistry()
    registry.register(LoadSignals([
        (FakeEngine(model_name="smol"), FakeReading(EngineStats(running=1, waiting=1)), lambda: 0),
        (FakeEngine(EngineState.BACKOFF, "gemma"), FakeReading(EngineStats(running=9)), lambda: 2),
    ], lambda: 3))
    text = generate_latest(registry).decode()
    assert value(text, "vllm:num_requests_running", model_name="smol") == 1
    assert value(text, "vllm:num_requests_waiting", model_name="smol") == 1 + 3
    assert value(text, "vllm:num_requests_running", model_name="gemma") == 0
    assert value(text, "vllm:num_requests_waiting", model_name="gemma") == 2
