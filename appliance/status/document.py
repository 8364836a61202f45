"""The status document: what the page at / shows and /status.json gives scripts, in one place."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter

from appliance.admission.slots import Admission
from appliance.core.engine import EngineView
from appliance.core.settings import Settings
from appliance.observe.metrics import RequestMetrics
from appliance.recovery.quarantine import Quarantine
from appliance.routes.models import ServedModels
from appliance.status.recent import EngineReading, Recent


@dataclass(frozen=True)
class StatusSources:
    """Everything the document is read from; each read is cheap (no I/O, no lock)."""

    settings: Settings
    engine: EngineView
    admission: Admission
    metrics: RequestMetrics
    recent: Recent
    engine_reading: EngineReading
    quarantine: Quarantine
    models: ServedModels | None = None  # None: the one model is `engine`


def status_document(sources: StatusSources) -> dict[str, Any]:
    """Engine (state, model, uptime, restarts, recent exits, GPU), requests (with those
    quarantined), recent rates."""
    reading = sources.engine_reading()
    metrics, recent = sources.metrics, sources.recent
    series = recent.series()
    return {
        "at": round(time.time(), 1),
        "refresh_s": sources.settings.status.refresh_s,
        "engine": sources.engine.snapshot(),
        "models": _models(sources),
        "requests": {
            "in_flight": sources.admission.in_flight,
            "max_inflight": sources.settings.policy.max_inflight,
            "engine_running": reading.running if reading is not None else None,
            "engine_waiting": reading.waiting if reading is not None else None,
            "rejected": _by_label(metrics.rejections, "reason"),
            "disconnect_aborts": _by_label(metrics.disconnects, "stream"),
            "quarantined": sources.quarantine.snapshot(),
        },
        "recent": {
            "window_s": sources.settings.status.rate_window_s,
            "tokens_per_s": series["tokens_per_s"][-1] if series["t"] else None,
            "mean_ttft_s": recent.mean_ttft(),
            "series": series,
        },
    }


def _models(sources: StatusSources) -> list[dict[str, Any]]:
    """A row per model of the catalog: its names, its worker's state, pid and restarts."""
    if sources.models is None:
        engine = sources.engine
        return [{"name": engine.model_name, "aliases": [], "state": engine.state.value,
                 "pid": engine.pid, "restarts": engine.snapshot().get("restarts"),
                 "default": True, "pinned": True}]
    return [{"name": model.name, "aliases": list(model.entry.aliases),
             "state": model.engine.state.value, "pid": model.engine.pid,
             "restarts": model.engine.snapshot().get("restarts"),
             "default": model.entry.default, "pinned": model.entry.pinned}
            for model in sources.models]


def _by_label(counter: Counter, label: str) -> dict[str, float]:
    """A counter's totals by one label, through the public collect() API."""
    found: dict[str, float] = {}
    for family in counter.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                key = sample.labels[label]
                found[key] = found.get(key, 0.0) + sample.value
    return found
