"""Prometheus metrics of the appliance, plus the engine's own counters re-exported."""

from __future__ import annotations

import re
import time

import httpx
import structlog
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from appliance.engine import EngineState, EngineView

log = structlog.get_logger("appliance.metrics")

# The worker's gauges an operator needs, under the appliance's name, so nobody scrapes :8100.
_ENGINE_GAUGES = {
    "vllm:num_requests_running": "appliance_engine_requests_running",
    "vllm:num_requests_waiting": "appliance_engine_requests_waiting",
    "vllm:kv_cache_usage_perc": "appliance_engine_kv_cache_usage_ratio",
}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)")
_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/health",
                     "/livez", "/metrics"})
_QUIET_ROUTES = frozenset({"/health", "/livez", "/metrics"})  # polled: an access line each is noise
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Every appliance metric in one registry of its own (tests build as many as they like)."""

    def __init__(self, engine: EngineView) -> None:
        self._engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("appliance_requests", "Requests answered, by route and status.",
                                ["route", "status"], registry=r)
        self.duration = Histogram("appliance_request_duration_seconds",
                                  "Time from request to last byte.", ["route"],
                                  buckets=_LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("appliance_time_to_first_token_seconds",
                              "Time from request to the first streamed chunk.", ["route"],
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("appliance_requests_in_flight",
                               "Generation requests admitted and not yet answered.", registry=r)
        self.rejections = Counter("appliance_rejections", "Requests refused, by reason.",
                                  ["reason"], registry=r)
        self.clamps = Counter("appliance_max_tokens_clamped",
                              "Requests whose max_tokens was lowered to the room left.",
                              registry=r)
        self.disconnects = Counter("appliance_client_disconnects",
                                   "Requests the client abandoned; upstream aborted.",
                                   ["stream"], registry=r)
        self.engine_state = Gauge("appliance_engine_state",
                                  "1 for the engine's current state.", ["state"], registry=r)
        self.restarts = Counter("appliance_engine_restarts",
                                "Worker restarts, by cause.", ["cause"], registry=r)
        self.transitions = Counter("appliance_engine_transitions",
                                   "Engine state transitions.", ["to"], registry=r)
        self._engine_gauges = {
            name: Gauge(target, f"The worker's {name}.", registry=r)
            for name, target in _ENGINE_GAUGES.items()
        }
        self.gpu = Gauge("appliance_gpu", "GPU readings from NVML.", ["reading"], registry=r)
        self._client: httpx.AsyncClient | None = None

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Counts every answer by route and status, times it to the last byte, and times a
        stream's first chunk (time to first token), without touching the bytes."""

        async def measured(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            route = scope["path"] if scope["path"] in _ROUTES else "other"
            started = time.perf_counter()
            status = 500
            first_body = True

            async def send_measured(message: Message) -> None:
                nonlocal status, first_body
                if message["type"] == "http.response.start":
                    status = message["status"]
                elif message["type"] == "http.response.body":
                    if first_body and message.get("more_body") and status == 200:
                        self.ttft.labels(route=route).observe(time.perf_counter() - started)
                    first_body = False
                await send(message)

            try:
                await app(scope, receive, send_measured)
            finally:
                elapsed = time.perf_counter() - started
                self.requests.labels(route=route, status=str(status)).inc()
                self.duration.labels(route=route).observe(elapsed)
                if route not in _QUIET_ROUTES:  # an access line, request id bound by the caller
                    log.info("request.completed", method=scope["method"], route=route,
                             status=status, duration_ms=round(elapsed * 1000, 1))

        return measured

    def observe_transition(self, old: EngineState, new: EngineState, cause: str) -> None:
        self.transitions.labels(to=new.value).inc()

    def observe_restart(self, cause: str) -> None:
        self.restarts.labels(cause=cause).inc()

    async def render(self) -> tuple[bytes, str]:
        for state in EngineState:
            self.engine_state.labels(state=state.value).set(
                1 if self._engine.state is state else 0)
        await self._scrape_engine()
        gpu = self._engine.snapshot().get("gpu") or {}
        for key, value in (gpu.get("gauges") or {}).items():
            self.gpu.labels(reading=key).set(value)
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    async def _scrape_engine(self) -> None:
        if self._engine.state is not EngineState.READY:
            return
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self._engine.base_url,
                                             timeout=httpx.Timeout(2.0), trust_env=False)
        try:
            text = (await self._client.get("/metrics")).text
        except httpx.HTTPError as exc:
            log.warning("metrics.engine_scrape_failed", error=type(exc).__name__)
            return
        for name, value in parse_engine_metrics(text).items():
            self._engine_gauges[name].set(value)

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()


def parse_engine_metrics(text: str) -> dict[str, float]:
    """Sum the worker's samples of the gauges we re-export (one per model label)."""
    found: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match and match.group(1) in _ENGINE_GAUGES:
            found[match.group(1)] = found.get(match.group(1), 0.0) + float(match.group(3))
    return found
