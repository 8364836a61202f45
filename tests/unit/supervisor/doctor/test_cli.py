"""`chat-appliance doctor` prints its findings (text, JSON) and exits 1 on a blocker; `serve`
refuses a box with a lasting blocker with exit status 2 (the unit's RestartPreventExitStatus)
and its one-line reason."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import structlog.testing

import supervisor.doctor as doctor
import supervisor.serve
from appliance.core.settings import Settings
from supervisor.doctor.report import Finding, Level, blocker, ok, warning
from supervisor.main import EXIT_CONFIG, main


def _fake_checks(monkeypatch: pytest.MonkeyPatch, *findings: Finding) -> None:
    monkeypatch.setattr(doctor, "FAST_CHECKS", tuple((lambda box, s, f=f: f) for f in findings))


def test_doctor_on_this_cpu_box_passes_and_prints_json(capsys: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHAT_APPLIANCE_CONFIG", raising=False)
    assert main(["doctor", "--json", "--user", "root"]) == 0
    findings = {f["check"]: f for f in json.loads(capsys.readouterr().out)}
    assert findings["driver"] == {"check": "driver", "level": "skip", "message":
                                  "no GPU: CPU engine", "fix": "", "lasting": True, "detail": {}}
    assert findings["config"]["level"] == "ok"


def test_doctor_exits_1_on_a_bad_config_and_says_so(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch,
                                                   tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[engine]\nport = 0\n")
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(bad))
    assert main(["doctor"]) == 1
    assert capsys.readouterr().out.startswith("blocker  config         engine.port")


def test_serve_refuses_a_lasting_blocker_with_exit_2_and_one_line(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("CHAT_APPLIANCE_CONFIG", raising=False)
    _fake_checks(monkeypatch, ok("uvm", "fine"),
                 blocker("driver", "driver 570.86, CUDA 13.0", "upgrade the driver to 580"))

    async def never(_: Settings) -> int:
        raise AssertionError("serve must not start")

    monkeypatch.setattr(supervisor.serve, "serve", never)
    assert main(["serve"]) == EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the logged findings
    assert err == ("chat-appliance: cannot start: driver: driver 570.86, CUDA 13.0; "
                   "fix: upgrade the driver to 580")


def test_serve_starts_despite_warnings_and_passing_blockers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHAT_APPLIANCE_CONFIG", raising=False)
    _fake_checks(monkeypatch, warning("disk", "low", "free some"),
                 blocker("gpu-memory", "held by another process", "free it", lasting=False))
    started = []

    async def fake_serve(_: Settings) -> int:
        started.append(True)
        return 0

    monkeypatch.setattr(supervisor.serve, "serve", fake_serve)
    with structlog.testing.capture_logs() as logged:
        assert main(["serve"]) == 0 and started
    said = [(e["check"], e["verdict"], e["fix"]) for e in logged if e["event"] == "doctor.finding"]
    assert said == [("disk", "warning", "free some"), ("gpu-memory", "blocker", "free it")]


def test_the_fast_checks_pass_on_this_cpu_box(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CHAT_APPLIANCE_CONFIG", raising=False)
    levels = {f.check: f.level for f in doctor.fast_checks(Settings())}
    assert levels["driver"] is Level.SKIP and levels["access"] is Level.OK
