"""What every step of a request shares: the app's dependencies, and the request's ticket (what it
is, for whom, on which route)."""

from __future__ import annotations

from dataclasses import dataclass

from appliance.admission.slots import Admission
from appliance.core.engine import EngineView
from appliance.core.sections import ResumeSettings
from appliance.core.upstream import Upstream
from appliance.gate.gate import Gate
from appliance.observe.metrics import RequestMetrics
from appliance.policy.cost_watch import CostWatch
from appliance.proxy.outbound import Outbound
from appliance.recovery.quarantine import Quarantine


@dataclass(frozen=True)
class RelayDeps:
    """What every relay needs, built once per app."""

    engine: EngineView
    admission: Admission
    gate: Gate
    upstream: Upstream
    metrics: RequestMetrics
    resume: ResumeSettings
    quarantine: Quarantine
    cost: CostWatch


@dataclass(frozen=True, eq=False)
class Ticket:
    """One request as it came: its identity (eq=False) is its key in the engine's ledger of
    waiting work (appliance.core.engine.Waiting)."""

    outbound: Outbound
    request_id: str
    route: str  # the route's template, for the metrics' label
    forward: dict[str, str]  # request headers passed on to the worker
