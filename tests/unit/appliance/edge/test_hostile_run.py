"""load/hostile/run.py, briefly, against serve over the synthetic worker (issue 9: RSS and fds
before and after a hostile run, the steady state within a stated bound)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from load.hostile.attacks import ATTACKS
from tests.support.stack import ROOT, Stack
from tests.unit.appliance.edge.limits import CUT_OFF_S, FD_SLACK, RSS_GROWTH_MIB

RUN_LIMIT_S = 240

pytestmark = pytest.mark.long  # every attack held, then settled: about 45 s


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("results")


@pytest.fixture(scope="module")
def run(stack: Stack, results: Path) -> Iterator[subprocess.CompletedProcess[str]]:
    command = [sys.executable, "-m", "load.hostile.run", "--url", stack.url, "--pid", str(stack.pid),
               "--scale", "0.05", "--hold", "1", "--settle", str(CUT_OFF_S),
               "--rss-growth-mib", str(RSS_GROWTH_MIB), "--fd-slack", str(FD_SLACK),
               "--results", str(results)]
    yield subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=RUN_LIMIT_S,
                         check=False)


def test_a_hostile_run_reports_every_attack(run: subprocess.CompletedProcess[str]) -> None:
    """The run ends on its own (within RUN_LIMIT_S) with a table row per attack, a verdict,
    and an exit status that is the verdict (0 or 1, not a crash)."""
    assert run.returncode in (0, 1), run.stderr[-2000:]
    rows = {line.split("  ")[0].strip() for line in run.stdout.splitlines()}
    assert set(ATTACKS) <= rows, run.stdout
    assert "baseline" in run.stdout and ("ok" in run.stdout or "OVER BOUND" in run.stdout)


def test_the_appliance_sheds_a_hostile_run_on_its_own(run: subprocess.CompletedProcess[str],
                                                     stack: Stack) -> None:
    """#2/#3/#4/#9: after each attack, with the attacker still holding its connections, RSS is
    within RSS_GROWTH_MIB and descriptors within FD_SLACK of the baseline: exit status 0. The
    appliance still serves afterwards."""
    assert run.returncode == 0, run.stdout + run.stderr[-1000:]
    assert httpx.get(f"{stack.url}/livez", timeout=10).status_code == 200


def test_the_run_writes_its_dated_result(run: subprocess.CompletedProcess[str],
                                         results: Path) -> None:
    """Its table, with the command that made it, lands in one dated file under --results."""
    [written] = results.glob("*-hostile-run.md")
    text = written.read_text()
    assert "`python -m load.hostile.run --url " in text and "--results" in text
    assert all(name in text for name in ATTACKS), text
