"""The self-test's report and verdicts: exit status, summary, JSON, the canary's reading, consent."""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from appliance.core.settings import Settings
from supervisor.doctor.report import blocker, ok, warning
from supervisor.selftest import command
from supervisor.selftest.canary import CanaryKey, CanaryStore
from supervisor.selftest.report import Check, CheckFailed, Report, timed
from supervisor.selftest.sequence import canary_check, doctor_check
from supervisor.selftest.target import Target


def report(*checks: Check) -> Report:
    return Report("temporary", "http://127.0.0.1:1", [], list(checks))


def test_passes_and_skips_exit_0_one_failure_exits_1_and_is_named() -> None:
    fine = report(Check("a", True, "fine"), Check("gpu", None, "no GPU"))
    assert fine.exit_status() == 0 and fine.summary().endswith("PASS in 0 s")
    broken = report(Check("a", True, "fine"), Check("canary", False, "mismatch: prompt 1"))
    assert broken.exit_status() == 1
    assert "FAIL  canary" in broken.summary() and "FAIL (canary)" in broken.summary()
    document = json.loads(broken.to_json())
    assert document["ok"] is False
    assert [c["verdict"] for c in document["checks"]] == ["pass", "FAIL"]


def test_a_report_with_no_checks_is_no_pass() -> None:
    assert report().exit_status() == 1


def test_a_check_that_raises_is_a_failure_with_its_reason() -> None:
    def broken() -> Check:
        raise CheckFailed("not ready again within 5 s")

    check = timed("kill -9 → ready", broken)
    assert check.ok is False and check.detail == "CheckFailed: not ready again within 5 s"


def test_doctor_blockers_fail_warnings_do_not() -> None:
    assert doctor_check([ok("disk", "fine"), warning("ports", "in use", "")]).ok is True
    failed = doctor_check([ok("disk", "fine"), blocker("driver", "too old", "upgrade")])
    assert failed.ok is False and "driver: too old" in failed.detail


def health_target(answers: Iterator[dict[str, Any]]) -> Target:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=next(answers))

    client = httpx.Client(transport=httpx.MockTransport(handler), base_url="http://appliance")
    return Target("http://appliance", {}, "m", 2, 5.0, client)


def test_canary_check_waits_for_the_serving_workers_verdict() -> None:
    old = {"verdict": "pass", "worker": 10, "detail": "3 greedy answers as recorded"}
    new = {"verdict": "mismatch", "worker": 11, "detail": "prompt 1 gave [5], recorded [6]"}
    target = health_target(iter([{"pid": 11, "canary": old}, {"pid": 11, "canary": new}]))
    check = canary_check(target, "canary")
    assert check.ok is False and check.detail == "mismatch: prompt 1 gave [5], recorded [6]"
    recorded = {"verdict": "recorded", "worker": 12, "detail": "recorded 3 answers"}
    assert canary_check(health_target(iter([{"pid": 12, "canary": recorded}])), "c").ok is True


def test_without_consent_the_running_service_is_left_alone(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    touched: list[str] = []
    monkeypatch.setattr(command, "_answers", lambda url, verify: True)
    def doctor() -> list[Any]:
        touched.append("doctor")
        return []

    monkeypatch.setattr(command, "all_checks", doctor)
    monkeypatch.setattr(command, "run_checks", lambda *a: touched.append("checks"))
    args = argparse.Namespace(yes=False, temporary=False, json=False, record_canary=False)
    assert command.selftest(args, Settings()) == command.EXIT_REFUSED
    assert touched == []
    said = capsys.readouterr().err
    assert "--yes" in said and "kill -9 of the worker" in said and "--temporary" in said


def test_record_canary_forgets_the_models_records_before_the_run(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The run that follows records them again (a worker start with no record records)."""
    settings = Settings(engine={"model": "/models/a"}, canary={"file": tmp_path / "c.json"})
    store = CanaryStore(tmp_path / "c.json")
    store.put(CanaryKey("/models/a", "float32", "cpu", "0.32.0"), [[1]])
    store.put(CanaryKey("/models/b", "float32", "cpu", "0.32.0"), [[2]])
    seen: list[Any] = []
    monkeypatch.setattr(command, "_answers", lambda url, verify: False)
    monkeypatch.setattr(command, "all_checks", lambda: [])
    def temporary(*_: Any) -> Report:
        seen.append(store.get(CanaryKey("/models/a", "float32", "cpu", "0.32.0")))
        return report(Check("canary", True, "recorded"))

    monkeypatch.setattr(command, "_temporary", temporary)
    args = argparse.Namespace(yes=False, temporary=False, json=False, record_canary=True)
    assert command.selftest(args, settings) == 0
    assert seen == [None]  # gone before the run began
    assert store.get(CanaryKey("/models/b", "float32", "cpu", "0.32.0")) == [[2]]


def test_waiting_for_ready_ends_at_once_on_a_failed_engine_or_a_gone_instance() -> None:
    failed = {"state": "failed", "pid": None, "last_exit": {"detail": "never became ready"}}
    target = health_target(iter([failed]))
    with pytest.raises(CheckFailed, match="the engine failed: never became ready"):
        target.wait_ready(timeout_s=60)
    starting = health_target(iter([{"state": "starting", "pid": None}] * 3))
    starting.gone = lambda: "the instance exited with status 2"
    with pytest.raises(CheckFailed, match="exited with status 2"):
        starting.wait_ready(timeout_s=60)
