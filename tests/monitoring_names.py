"""The metric names monitoring/ queries (alert rules, dashboard) and the names a /metrics exposes."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

MONITORING = Path(__file__).resolve().parents[1] / "monitoring"
ALERTS = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RULE_TESTS = sorted((MONITORING / "tests").glob("*.yml"))
GPU_ONLY = "appliance_gpu_"  # series that exist only where NVML sees a GPU

_NAME = re.compile(r"\b(appliance_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
_TYPE_LINE = re.compile(r"^# TYPE ([a-zA-Z_:][a-zA-Z0-9_:]*) (\w+)$", re.M)
_SAMPLE_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)[{ ]", re.M)
_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("", "_sum", "_count"),
}


def alert_rules() -> list[dict[str, Any]]:
    """Every alerting rule of alerts.yml, across its groups."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def dashboard() -> dict[str, Any]:
    return dict(json.loads(DASHBOARD.read_text()))


def dashboard_exprs() -> list[str]:
    """The PromQL of every panel target and every templating query of the dashboard."""
    board = dashboard()
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            exprs.append(variable["definition"])
    return exprs


def names_used() -> dict[str, set[str]]:
    """Metric name → where it is used ('alerts.yml: ApplianceDown', 'dashboard: GPU memory')."""
    used: dict[str, set[str]] = {}
    for rule in alert_rules():
        for name in _NAME.findall(rule["expr"]):
            used.setdefault(name, set()).add(f"alerts.yml: {rule['alert']}")
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            for name in _NAME.findall(target["expr"]):
                used.setdefault(name, set()).add(f"dashboard: {panel['title']}")
    return used


def exposed_names(text: str) -> set[str]:
    """Sample names a Prometheus text exposition offers, counting declared families that have
    no sample yet (a labelled counter before its first increment) under their usual suffixes."""
    names = set(_SAMPLE_LINE.findall(text))
    for family, kind in _TYPE_LINE.findall(text):
        if kind == "counter":
            family = family.removesuffix("_total")
        names.update(family + suffix for suffix in _SUFFIXES.get(kind, ("",)))
    return names
