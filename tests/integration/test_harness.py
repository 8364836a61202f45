"""The harness's leak guard: what an appliance started dies with the test, whatever its session.

Over the synthetic worker (a boot takes about a second): the worker leads its own session, as
vLLM's does, so a supervisor killed outright leaves it running; the guard must find it anyway.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from load.kit.appliance import running_synthetic_appliance
from supervisor.engine.worker import session_members

pytestmark = pytest.mark.synthetic  # no vLLM: the synthetic worker


def test_a_worker_left_by_a_killed_supervisor_is_killed_by_the_guard(tmp_path: Path) -> None:
    with running_synthetic_appliance(tmp_path) as appliance:
        appliance.wait_ready(60)
        worker = appliance.worker_pid()
        appliance.proc.kill()  # no drain, no stop: the supervisor cannot clean up after itself
        appliance.proc.wait(10)
        assert session_members(worker), "the worker outlives its supervisor (its own session)"
        assert worker in {p.pid for p in appliance.tree()}
    assert not session_members(worker), "the guard killed the worker's whole session"
