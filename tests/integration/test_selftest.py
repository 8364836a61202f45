"""`chat-appliance selftest` on the real CPU default: a temporary instance of its own passes
(kill -9 and freeze back to ready, the canary recorded then as recorded, nothing left), and a
running appliance whose recorded canary was changed fails it, with the reason on /status.json,
/health and /metrics while it keeps serving."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest

from load.kit.appliance import TREE_MARKER, Appliance, marked, require_engine, running_appliance
from load.kit.isolation import clean_env
from tests.metrics_text import samples, value

pytestmark = pytest.mark.long  # two whole self-test runs, about a minute: `pytest -m long`

SELFTEST_BUDGET_S = 180  # the bar for a whole run on the CPU default
CANARY_WAIT_S = 120


def selftest(env: dict[str, str], *args: str) -> tuple[int, dict[str, Any], str]:
    """Run the command; its exit status, its JSON report and its summary."""
    result = subprocess.run([sys.executable, "-m", "supervisor.main", "selftest", "--json", *args],
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.stdout, result.stderr[-3000:]
    return result.returncode, dict(json.loads(result.stdout)), result.stderr


def checks(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {check["name"]: check for check in report["checks"]}


def test_a_temporary_instance_passes_and_leaves_nothing(tmp_path: Path) -> None:
    require_engine()
    marker = uuid.uuid4().hex
    env = clean_env() | {"CHAT_APPLIANCE_CANARY__FILE": str(tmp_path / "canary.json"),
                         TREE_MARKER: marker}
    started = time.monotonic()
    status, report, summary = selftest(env, "--yes", "--temporary")
    took = time.monotonic() - started
    print(summary)
    print(f"selftest --temporary took {took:.0f} s")
    assert status == 0, summary
    assert report["ok"] is True and report["mode"] == "temporary"
    found = checks(report)
    for name in ("kill -9 → ready", "freeze → ready", "disconnect aborts the engine's work",
                 "no process left behind", "/v1/responses", "/v1/messages", "gate: n cap"):
        assert found[name]["ok"] is True, found[name]
    assert found["kill -9 → ready"]["measured"]["left"] == 0
    assert found["freeze → ready"]["measured"]["exit_reason"] == "hung"
    assert found["freeze → ready"]["measured"]["request_status"] == 200
    assert found["canary"]["measured"]["verdict"] == "recorded"  # a fresh record: first start
    assert found["canary after the faults"]["measured"]["verdict"] == "pass"
    assert json.loads((tmp_path / "canary.json").read_text())["records"]
    assert marked(marker) == []  # independently of its own check
    assert took < SELFTEST_BUDGET_S


def canary_of(appliance: Appliance) -> dict[str, Any]:
    """/health's canary verdict once the worker serving now is judged."""
    deadline = time.monotonic() + CANARY_WAIT_S
    while time.monotonic() < deadline:
        detail = appliance.health().json()
        canary = detail.get("canary") or {}
        if canary.get("worker") == detail.get("pid"):
            return dict(canary)
        time.sleep(0.2)
    raise AssertionError("no canary verdict for the serving worker")


def test_a_changed_record_fails_the_selftest_and_the_status_says_why(tmp_path: Path) -> None:
    with running_appliance(tmp_path) as appliance:
        appliance.wait_ready()
        assert canary_of(appliance)["verdict"] == "recorded"
        record = tmp_path / "canary.json"
        data = json.loads(record.read_text())
        [entry] = data["records"].values()
        entry["token_ids"][0][0] += 1  # as if the engine had answered otherwise at install
        record.write_text(json.dumps(data))
        env = clean_env() | {"CHAT_APPLIANCE_SERVER__PORT": appliance.url.rsplit(":", 1)[1],
                             "CHAT_APPLIANCE_CANARY__FILE": str(record)}
        status, report, summary = selftest(env, "--yes")
        print(summary)
        assert status == 1 and report["mode"] == "running"
        after = checks(report)["canary after the faults"]
        assert after["ok"] is False and after["measured"]["verdict"] == "mismatch"
        assert checks(report)["kill -9 → ready"]["ok"] is True  # only the canary failed
        assert [c["name"] for c in report["checks"] if c["ok"] is False] == [
            "canary after the faults"]
        page = httpx.get(f"{appliance.url}/status.json", timeout=5).json()["engine"]["canary"]
        assert page["verdict"] == "mismatch" and page["ok"] is False
        assert "prompt 0 gave" in page["detail"] and "recorded" in page["detail"]
        assert appliance.health().status_code == 200  # an alert, not a box taken down
        metrics = httpx.get(f"{appliance.url}/metrics", timeout=5).text
        assert value(metrics, "appliance_canary_ok") == 0
        assert any(name == "appliance_canary_ok" and dict(labels).get("model")
                   for name, labels in samples(metrics))  # labelled with its model
        assert appliance.wait_for_event(lambda e: e.get("event") == "engine.canary_mismatch")
