"""The API's own Prometheus metrics: answers, latencies, refusals, disconnects, failures.

The `client` label is the caller's client name from the key guard ("anonymous" for plain keys,
"none" before or without a key check): bounded by the configured clients. Names are a secret of
sorts (who uses this box, and how much): where /metrics is open to anyone
(server.protect_ops_routes off) every named client is counted as "named".

Facts the API does not own (engine state, restarts, the worker's gauges, the GPU) are exported
by the supervisor's collector into the same registry; see supervisor/observe/collector.py.
"""

from __future__ import annotations

import time
from typing import Any, TypeVar

import structlog
from litestar.enums import ScopeType
from litestar.types import ASGIApp, Message, Receive, Scope, Send
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client import generate_latest as _generate_latest
from prometheus_client.metrics import MetricWrapperBase

from appliance.admission.clients import ANONYMOUS
from appliance.core.context import CLIENT_NAME, NO_CLIENT
from appliance.core.errors import ApiError
from appliance.core.latency import LATENCY_BUCKETS
from appliance.fences.litestar import handler_of, route_of

log = structlog.get_logger("appliance.observe.metrics")

M = TypeVar("M", bound=MetricWrapperBase)
UNROUTED = "other"  # the label for paths no route serves: bounded cardinality
ARRIVED = "chat-appliance.arrived"  # the scope key of the request's arrival (perf_counter)
UNNAMED = frozenset({ANONYMOUS, NO_CLIENT})  # labels that name nobody
NAMED = "named"  # every named client, where /metrics shows no names
CLIENT_CLOSED = 499  # the status counted for a request its client left unanswered (nginx's)


class RequestMetrics:
    """Every request-level metric, in the registry it is given."""

    def __init__(self, registry: CollectorRegistry, *, client_names: bool = True) -> None:
        self.registry = r = registry
        self._client_names = client_names
        self.requests = Counter("appliance_requests",
                                "Requests answered, by route, status and client.",
                                ["route", "status", "client"], registry=r)
        self.duration = Histogram("appliance_request_duration_seconds",
                                  "Time from request to last byte.", ["route"],
                                  buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram("appliance_time_to_first_token_seconds",
                              "Time from request to the first streamed chunk.", ["route"],
                              buckets=LATENCY_BUCKETS, registry=r)
        # The same over every route, kept as it is observed: the status sampler reads it each
        # second, and summing the histogram's samples costs 340 us for four routes.
        self.ttft_sum = 0.0
        self.ttft_count = 0
        self.in_flight = Gauge("appliance_requests_in_flight",
                               "Sequences of the generation requests admitted and not yet "
                               "answered (a request counts its prompts x n).", registry=r)
        self.rejections = Counter("appliance_rejections", "Requests refused, by reason and client.",
                                  ["reason", "client"], registry=r)
        self.queued = Gauge("appliance_admission_queued",
                            "Generation requests waiting for an admission slot.", registry=r)
        self.clamps = Counter("appliance_max_tokens_clamped",
                              "Requests whose max_tokens was lowered to the room left.", registry=r)
        self.too_costly = Counter("appliance_requests_too_costly",
                                  "Constrained requests aborted for keeping the engine's time "
                                  "per token far above its norm while others waited.", registry=r)
        self.disconnects = Counter("appliance_client_disconnects",
                                   "Requests the client abandoned; upstream aborted.",
                                   ["stream"], registry=r)
        self.outlived = Counter("appliance_engine_faults_outlived",
                                "Requests that met an engine fault and went on on the new "
                                "worker: replayed (nothing had reached the client) or resumed "
                                "(a stream continued where it stopped).", ["route", "how"],
                                registry=r)
        self.quarantines = Counter("appliance_requests_quarantined",
                                   "Requests refused (request_quarantined): in flight at "
                                   "resume.quarantine_after engine deaths.", registry=r)
        self.unhandled_exceptions = Counter("appliance_unhandled_exceptions",
                                            "Requests that failed on a bug of the appliance.",
                                            ["route"], registry=r)
        # Each metric's child per label values, as every request asks for them: `labels()`
        # sorts its keywords, makes strings of the values and takes a lock, every time.
        self._children: dict[tuple[Any, ...], Any] = {}

    def middleware(self, app: ASGIApp) -> ASGIApp:
        """Counts every answer by route and status and times it to the last byte; writes the
        access line. Route labels and quietness are declared on the handlers (route opt)."""

        async def measured(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] != ScopeType.HTTP:
                await app(scope, receive, send)
                return
            started = scope[ARRIVED] = time.perf_counter()  # type: ignore[literal-required]
            # An app that returns without answering had nobody to answer: its client left.
            status = CLIENT_CLOSED

            async def send_measured(message: Message) -> None:
                nonlocal status
                if message["type"] == "http.response.start":
                    status = message["status"]
                await send(message)

            try:
                await app(scope, receive, send_measured)
            except BaseException:
                status = 500 if status == CLIENT_CLOSED else status
                raise
            finally:
                self._count(scope, status, time.perf_counter() - started)

        return measured

    def _count(self, scope: Scope, status: int, elapsed: float) -> None:
        handler = handler_of(scope)
        route = (route_of(scope) or UNROUTED) if handler is not None else UNROUTED
        self._child(self.requests, route, str(status), self._client()).inc()
        self._child(self.duration, route).observe(elapsed)
        if handler is None or not handler.opt.get("quiet"):
            log.info("request.completed", method=scope.get("method"), route=route,
                     status=status, duration_ms=round(elapsed * 1000, 1))

    def first_token(self, route: str, seconds: float) -> None:
        """A stream's first chunk went out `seconds` after the request arrived."""
        self._child(self.ttft, route).observe(seconds)
        self.ttft_sum += seconds
        self.ttft_count += 1

    def disconnected(self, stream: bool) -> None:
        self._child(self.disconnects, "true" if stream else "false").inc()

    def error_answered(self, error: ApiError, route: str) -> None:
        """Every error answer counts as a rejection by its reason; a bug of ours also by route
        (appliance.answers.answer logs it)."""
        self._child(self.rejections, error.reason, self._client()).inc()
        if error.bug is not None:
            self._child(self.unhandled_exceptions, route).inc()

    def _child(self, metric: M, *values: str) -> M:
        """`metric.labels(*values)`, in the order of its label names; kept once made."""
        key = (metric, *values)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(*values)
        return child

    def _client(self) -> str:
        name = CLIENT_NAME.get()
        return name if self._client_names or name in UNNAMED else NAMED

    def quarantined(self, fingerprint: str) -> None:
        """A request was refused by the quarantine (its fingerprint is in the log, not here:
        a label per fingerprint would be unbounded)."""
        self.quarantines.inc()

    def clamped(self) -> None:
        self.clamps.inc()

    def render(self) -> tuple[bytes, str]:
        return _generate_latest(self.registry), CONTENT_TYPE_LATEST


def arrived_at(scope: Scope) -> float:
    """When the request arrived (by the middleware's clock); now where no middleware noted it."""
    arrived = scope.get(ARRIVED)
    return arrived if isinstance(arrived, float) else time.perf_counter()
