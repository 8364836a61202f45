"""The worker's own Prometheus counters and gauges that tell whether it is busy and progressing."""

from __future__ import annotations

import re
from dataclasses import dataclass

from appliance.fences.vllm import Metric

_WANTED = {
    Metric.REQUESTS_RUNNING: "running",
    Metric.REQUESTS_WAITING: "waiting",
    Metric.KV_CACHE_USAGE: "kv_cache_usage",
    Metric.PROMPT_TOKENS: "prompt_tokens",
    Metric.GENERATION_TOKENS: "generation_tokens",
    Metric.ITERATION_TOKENS_COUNT: "iterations",
    Metric.PREEMPTIONS: "preemptions",
}
# Only the wanted series' lines. The probe asks for those alone (METRICS_PATH, ~1.3 KB), but a
# whole page (~65 KB, 600 lines, mostly histogram buckets) reads the same: a pattern that starts
# with a literal is searched for, not tried at each line.
_SAMPLE = re.compile("\n(" + "|".join(re.escape(name) for name in _WANTED) + ")"
                     r"(?:\{[^}\n]*\})?[ \t]+([-+0-9.eEinfNa]+)")


@dataclass(frozen=True)
class EngineStats:
    running: float = 0.0
    waiting: float = 0.0
    kv_cache_usage: float = 0.0
    prompt_tokens: float = 0.0
    generation_tokens: float = 0.0
    iterations: float = 0.0
    preemptions: float = 0.0

    @property
    def busy(self) -> bool:
        return self.running + self.waiting > 0

    @property
    def progress(self) -> tuple[float, float, float, float]:
        """Counters that move whenever the engine finishes a step."""
        return (self.prompt_tokens, self.generation_tokens, self.iterations, self.preemptions)


def parse_engine_stats(text: str) -> EngineStats:
    """Sum the worker's samples of each series we read (one per model/engine label)."""
    found: dict[str, float] = {}
    for name, value in _SAMPLE.findall("\n" + text):
        field = _WANTED[name]
        found[field] = found.get(field, 0.0) + float(value)
    return EngineStats(**found)
