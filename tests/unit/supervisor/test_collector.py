"""Supervisor facts reach /metrics through the collector, read at scrape time."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest

from appliance.core.engine import EngineState
from supervisor.engine.stats import EngineStats, parse_engine_stats
from supervisor.observe.collector import ObservedModel, SupervisorCollector
from tests.metrics_text import value


@dataclass
class FakeManager:
    state: EngineState = EngineState.READY
    restart_counts: Counter[str] = field(default_factory=Counter)
    transition_counts: Counter[str] = field(default_factory=Counter)


@dataclass
class FakeProgress:
    stats: EngineStats | None = None


class FakeGpu:
    def gauges(self) -> dict[str, float]:
        return {"gpu_up": 1.0, "gpu_temperature_celsius": 61.0, "gpu_xid_events_total": 2.0}


def scrape(manager: FakeManager, progress: FakeProgress, gpu: FakeGpu | None = None) -> str:
    registry = CollectorRegistry()
    registry.register(SupervisorCollector([ObservedModel("smol", manager, progress)],  # type: ignore[arg-type]
                                          gpu))
    return generate_latest(registry).decode()


def test_state_restarts_and_transitions_are_what_the_manager_holds_now() -> None:
    manager = FakeManager(restart_counts=Counter({"hung": 2, "exited": 1}),
                          transition_counts=Counter({"ready": 4}))
    text = scrape(manager, FakeProgress())
    assert value(text, "appliance_engine_state", state="ready") == 1
    assert value(text, "appliance_engine_state", state="failed") == 0
    assert value(text, "appliance_engine_restarts_total", cause="hung") == 2
    assert value(text, "appliance_engine_transitions_total", to="ready") == 4
    manager.state = EngineState.FAILED  # read at scrape time, not pushed
    assert value(scrape(manager, FakeProgress()), "appliance_engine_state", state="failed") == 1


def test_worker_gauges_come_from_the_last_progress_reading_while_ready() -> None:
    progress = FakeProgress(EngineStats(running=3, waiting=1, kv_cache_usage=0.5))
    text = scrape(FakeManager(), progress)
    assert value(text, "appliance_engine_requests_running") == 3
    assert value(text, "appliance_engine_requests_waiting") == 1
    assert value(text, "appliance_engine_kv_cache_usage_ratio") == 0.5
    stale = scrape(FakeManager(state=EngineState.BACKOFF), progress)
    assert "appliance_engine_requests_running" not in stale  # no worker: no stale readings


def test_gpu_readings_are_one_series_each_and_xids_a_counter() -> None:
    text = scrape(FakeManager(), FakeProgress(), FakeGpu())
    assert value(text, "appliance_gpu_up") == 1
    assert value(text, "appliance_gpu_temperature_celsius") == 61
    assert value(text, "appliance_gpu_xid_events_total") == 2


def test_engine_stats_are_summed_across_labels() -> None:
    text = ('# HELP vllm:num_requests_running x\nvllm:num_requests_running{model_name="a"} 2.0\n'
            'vllm:num_requests_running{model_name="b"} 1.0\nvllm:kv_cache_usage_perc{m="a"} 0.25\n'
            'vllm:num_requests_waiting_by_reason{r="x"} 9\nvllm:prompt_tokens_total{m="a"} 7\n')
    stats = parse_engine_stats(text)
    assert (stats.running, stats.kv_cache_usage, stats.waiting) == (3.0, 0.25, 0.0)
    assert stats.busy and stats.progress == (7.0, 0.0, 0.0, 0.0)


def test_each_model_is_its_own_series() -> None:
    """Two models: each state, restart count and reading under its own `model` label."""
    smol = FakeManager(restart_counts=Counter({"exited": 1}))
    gemma = FakeManager(state=EngineState.BACKOFF, restart_counts=Counter({"hung": 3}))
    registry = CollectorRegistry()
    registry.register(SupervisorCollector([
        ObservedModel("smol", smol, FakeProgress(EngineStats(running=2))),  # type: ignore[arg-type]
        ObservedModel("gemma", gemma, FakeProgress(EngineStats(running=5))),  # type: ignore[arg-type]
    ], None))
    text = generate_latest(registry).decode()
    assert value(text, "appliance_engine_state", model="smol", state="ready") == 1
    assert value(text, "appliance_engine_state", model="gemma", state="backoff") == 1
    assert value(text, "appliance_engine_restarts_total", model="smol") == 1
    assert value(text, "appliance_engine_restarts_total", model="gemma", cause="hung") == 3
    assert value(text, "appliance_engine_requests_running", model="smol") == 2
    assert value(text, "appliance_engine_requests_running", model="gemma") == 0  # not ready
