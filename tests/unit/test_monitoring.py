"""monitoring/: the alert rules pass promtool's checks and unit tests, the example Prometheus
config loads them, the dashboard's queries are valid PromQL, and the GPU series they query are
the ones the NVML monitor exports. promtool missing is a failure, not a skip: CI installs it."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from appliance.core.sections import GpuSettings
from supervisor.gpu.nvml import GpuMonitor
from tests.monitoring_names import (
    ALERTS,
    GPU_ONLY,
    MONITORING,
    RULE_TESTS,
    alert_rules,
    dashboard,
    dashboard_exprs,
    names_used,
)
from tests.unit.supervisor.gpu.test_nvml import FakeGpu

# Grafana's own variables, replaced by something PromQL accepts before promtool parses a query.
_GRAFANA_VARIABLES = {"$__rate_interval": "5m", "$__range": "1h", "$job": ".*", "$instance": ".*"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        pytest.fail("promtool not found: install Debian's `prometheus` package (apt-get install "
                    "prometheus); .ci/run does")
    return found


def run_promtool(promtool: str, *args: str, cwd: Path = MONITORING) -> str:
    result = subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True,
                            timeout=120, check=False)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_alert_rules_pass_promtool_check(promtool: str) -> None:
    output = run_promtool(promtool, "check", "rules", ALERTS.name)
    assert f"SUCCESS: {len(alert_rules())} rules found" in output


def test_alert_rule_unit_tests_pass(promtool: str) -> None:
    """Each alert fires on its trouble, stays quiet on the look-alike, with the exact summary."""
    assert RULE_TESTS, "no promtool rule tests under monitoring/tests"
    output = run_promtool(promtool, "test", "rules", *(str(path) for path in RULE_TESTS))
    assert output.count("SUCCESS") == len(RULE_TESTS), output


def test_example_prometheus_config_loads_the_rules(promtool: str, tmp_path: Path) -> None:
    """promtool wants the files the scrape names (the appliance's certificate and a key): the
    example is checked beside stand-ins for them, as an operator's copy would sit."""
    for name in ("prometheus.yml", ALERTS.name):
        shutil.copy(MONITORING / name, tmp_path / name)
    scrape = yaml.safe_load((MONITORING / "prometheus.yml").read_text())["scrape_configs"][0]
    assert scrape["scheme"] == "https"
    for name in (scrape["tls_config"]["ca_file"], scrape["authorization"]["credentials_file"]):
        (tmp_path / name).write_text("stand-in\n")
    output = run_promtool(promtool, "check", "config", "prometheus.yml", cwd=tmp_path)
    assert "SUCCESS: 1 rule files found" in output


def test_every_alert_has_a_firing_unit_test() -> None:
    """An alert no promtool test ever sees firing could have a dead expression."""
    fired = set()
    for path in RULE_TESTS:
        for case in yaml.safe_load(path.read_text())["tests"]:
            fired.update(check["alertname"] for check in case["alert_rule_test"]
                         if check["exp_alerts"])
    assert {rule["alert"] for rule in alert_rules()} - fired == set()


def test_every_alert_says_how_bad_what_and_what_to_do() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
        assert rule["annotations"]["summary"].strip(), rule["alert"]
        assert rule["annotations"]["runbook"].strip(), rule["alert"]


def test_dashboard_queries_are_valid_promql(promtool: str, tmp_path: Path) -> None:
    """Grafana shows a broken query as an empty panel; promtool refuses it here instead."""
    rules = []
    for number, expr in enumerate(dashboard_exprs()):
        for variable, value in _GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        expr = re.sub(r"^label_values\((\w+)(\{.*\})?, \w+\)$", r"\1\2", expr)  # a query variable
        rules.append({"record": f"dashboard:query_{number}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    run_promtool(promtool, "check", "rules", str(path))


def test_dashboard_is_importable_anywhere() -> None:
    """One stable uid, unique panel ids, the data source chosen on import, panels in the grid."""
    board = dashboard()
    assert board["uid"] == "chat-appliance"
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_gpu_series_in_monitoring_are_what_the_gpu_monitor_exports() -> None:
    """The GPU names cannot show on a machine without a GPU: a fake NVML produces them."""
    monitor = GpuMonitor(GpuSettings(), FakeGpu().module())
    monitor.open()
    monitor.poll()
    exported = {f"appliance_{key}" for key in monitor.gauges()}
    used = {name for name in names_used() if name.startswith(GPU_ONLY)}
    assert used, "the alerts and the dashboard watch no GPU series"
    assert used - exported == set(), f"not exported by GpuMonitor.gauges(): {used - exported}"
