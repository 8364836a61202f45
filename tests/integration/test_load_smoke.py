"""Locust smoke: the suite runs ~30 s against the real appliance and real CPU worker, chaos off."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from load.kit.appliance import Appliance

pytestmark = pytest.mark.long  # 30 s of locust: `pytest -m long`

ROOT = Path(__file__).resolve().parents[2]
SMOKE_S = 30
REPORTS = ("report.html", "stats_stats.csv", "stats_failures.csv", "summary.json")


def test_locust_suite_gets_an_acceptable_terminal_answer_for_every_request(
        appliance: Appliance, tmp_path: Path) -> None:
    """`load.locust.run` exits 0 (every status 2xx/4xx/503, every stream ended) and writes its reports."""
    out = tmp_path / "reports"
    command = [sys.executable, "-m", "load.locust.run", "--url", appliance.url, "--users", "4",
               "--duration", str(SMOKE_S), "--max-tokens", "16", "--timeout", "90",
               "--out", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True,
                            timeout=SMOKE_S + 300, check=False)
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}\n{appliance.tail()}"
    for name in REPORTS:
        assert (out / name).stat().st_size > 0, f"{name} missing or empty"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["by_status"].get("200", 0) > 0, summary  # load really reached the engine
    assert summary["ttft_ms"]["count"] > 0, summary  # and streams produced tokens
