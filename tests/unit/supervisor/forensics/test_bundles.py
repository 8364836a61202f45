"""Crash bundles: one per death, the oldest dropped past `keep`, each within `max_bytes`,
request bodies only when asked, and `chat-appliance crashes` lists and shows them."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from appliance.core.engine import Waiting
from appliance.core.sections import CrashSettings
from appliance.core.settings import Settings
from supervisor.engine.exits import ExitCause, ExitReason
from supervisor.engine.stats import EngineStats
from supervisor.engine.worker import StopReport
from supervisor.forensics.bundles import Bundles
from supervisor.forensics.command import crashes
from supervisor.forensics.recorder import Recorder
from supervisor.forensics.stacks import dump_stacks, proc_threads
from tests.unit.appliance.pending import SECRET, Pending

pytestmark = pytest.mark.anyio


@dataclass
class FakeWorker:
    pid: int = 4242
    returncode: int | None = None
    tail: deque[str] = field(default_factory=lambda: deque(f"line {i}" for i in range(500)))

    async def wait(self) -> int:
        return 0

    def tree_pids(self) -> set[int]:
        return {self.pid}

    async def stop(self, grace_s: float) -> StopReport:
        return StopReport(0, False, [])


def settings(tmp_path: Path, **crash: object) -> Settings:
    return Settings(crashes=CrashSettings(dir=tmp_path, **crash))  # type: ignore[arg-type]


def recorder(tmp_path: Path, waiting: Waiting, **crash: object) -> Recorder:
    return Recorder(settings(tmp_path, **crash), waiting,
                    metrics=lambda: EngineStats(running=1.0, generation_tokens=7.0),
                    gpu=lambda: {"status": "unavailable"}, py_spy="/nonexistent/py-spy")


def hung(at: float = 1_700_000_000.0) -> ExitCause:
    return ExitCause("running", ExitReason.HUNG, "busy with no progress", at=at)


async def test_a_death_leaves_one_bundle_with_the_requests_in_flight_but_not_their_bodies(
        tmp_path: Path) -> None:
    waiting = Waiting()
    waiting.add(object(), "req-1", Pending(SECRET))
    rec, worker = recorder(tmp_path, waiting), FakeWorker()
    rec.lost()
    await rec.before_stop(worker, hung())
    rec.stopped(worker, hung(), 0.4)
    names = rec.bundles.names()
    assert len(names) == 1 and rec.last == names[0] and "hung" in names[0]
    text = (tmp_path / f"{names[0]}.json").read_text()
    assert "secret" not in text
    bundle = json.loads(text)
    [request] = bundle["in_flight"]
    assert request["route"] == "/v1/chat/completions" and request["client"] == "team-a"
    assert request["body_bytes"] == len(SECRET) and request["request_id"] == "req-1"
    assert len(request["fingerprint"]) == 16
    assert bundle["engine_metrics"]["generation_tokens"] == 7.0
    assert bundle["log_tail"][-1] == "line 499" and len(bundle["log_tail"]) == 200
    assert "py-spy" in bundle["stacks"]["4242"]  # the tool is missing here: the bundle says so
    rec.recovered(ExitCause("running", ExitReason.HUNG, "busy with no progress",
                            at=1_700_000_000.0, restart={"total_s": 3.1}))
    rewritten = json.loads((tmp_path / f"{names[0]}.json").read_text())
    assert rewritten["cause"]["restart"] == {"total_s": 3.1}
    assert rec.bundles.names() == names  # rewritten, not a second bundle


async def test_bodies_are_written_only_when_the_setting_says_so(tmp_path: Path) -> None:
    waiting = Waiting()
    waiting.add(object(), "req-1", Pending(SECRET))
    rec = recorder(tmp_path, waiting, bodies=True)
    rec.lost()
    rec.stopped(FakeWorker(), hung(), 0.1)
    assert "my secret prompt" in (tmp_path / f"{rec.last}.json").read_text()


async def test_a_requested_stop_leaves_no_bundle(tmp_path: Path) -> None:
    rec = recorder(tmp_path, Waiting())
    rec.lost()
    rec.stopped(FakeWorker(), ExitCause("running", ExitReason.STOPPED, "stop requested"), 0.1)
    assert rec.bundles.names() == [] and rec.last is None


async def test_the_oldest_bundles_are_dropped_past_keep(tmp_path: Path) -> None:
    rec = recorder(tmp_path, Waiting(), keep=3)
    for i in range(5):
        rec.lost()
        rec.stopped(FakeWorker(pid=1000 + i), hung(at=1_700_000_000.0 + 60 * i), 0.1)
    names = rec.bundles.names()
    assert len(names) == 3 and [n.split("-")[1] for n in names] == ["1002", "1003", "1004"]


def test_a_bundle_over_max_bytes_is_trimmed_to_fit_and_says_so(tmp_path: Path) -> None:
    bundles = Bundles(CrashSettings(dir=tmp_path, max_bytes=16_384))
    bundle = {"pid": 1, "cause": hung().as_dict(), "log_tail": ["x" * 200] * 1000,
              "stacks": {"1": "y" * 100_000}, "in_flight": [{"route": "/v1/x"}] * 10}
    name = bundles.write(bundle)
    assert name is not None
    path = tmp_path / f"{name}.json"
    assert path.stat().st_size <= 16_384
    kept = json.loads(path.read_text())
    assert "log_tail" in kept["trimmed"] and kept["cause"]["reason"] == "hung"


def test_an_unwritable_directory_is_logged_not_raised(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert Bundles(CrashSettings(dir=blocker / "crashes")).write({"pid": 1}) is None


async def test_the_crashes_command_lists_and_shows_the_newest(tmp_path: Path) -> None:
    rec = recorder(tmp_path, Waiting())
    for i in range(2):
        rec.lost()
        rec.stopped(FakeWorker(pid=7000 + i), hung(at=1_700_000_000.0 + i), 0.2)
    out = io.StringIO()
    assert crashes(settings(tmp_path).crashes, None, False, out) == 0
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and "hung: busy with no progress" in lines[1]
    out = io.StringIO()
    assert crashes(settings(tmp_path).crashes, "last", False, out) == 0
    assert "pid 7001" in out.getvalue() and "line 499" in out.getvalue()
    assert crashes(settings(tmp_path).crashes, "../etc/passwd", False, io.StringIO()) == 1


async def test_stacks_of_a_stopped_process_are_read_from_proc_without_py_spy() -> None:
    child = await asyncio.create_subprocess_exec("sleep", "30")
    try:
        os.kill(child.pid, signal.SIGSTOP)
        # Polled: a signal landing has no event of its own.
        while f"{child.pid} sleep T" not in proc_threads(child.pid):  # noqa: ASYNC110
            await asyncio.sleep(0.01)
        stacks = await dump_stacks([child.pid], None, 5)
        assert "not installed" in stacks[str(child.pid)]
        assert f"{child.pid} sleep T" in stacks[str(child.pid)]
    finally:
        child.kill()
        await child.wait()


async def test_each_death_tells_its_in_flight_fingerprints_and_a_stop_tells_none(
        tmp_path: Path) -> None:
    """What the quarantine counts (appliance.recovery): the fingerprints the bundle names."""
    waiting, told = Waiting(), []
    waiting.add(object(), "req-1", Pending(SECRET))
    rec = Recorder(settings(tmp_path), waiting, metrics=lambda: None,
                   gpu=lambda: {"status": "unavailable"}, py_spy="/nonexistent/py-spy",
                   deaths=told.append)
    rec.lost()
    rec.stopped(FakeWorker(), hung(), 0.1)
    bundle = json.loads((tmp_path / f"{rec.last}.json").read_text())
    assert told == [[bundle["in_flight"][0]["fingerprint"]]]
    rec.lost()
    rec.stopped(FakeWorker(), ExitCause("running", ExitReason.STOPPED, "stop requested"), 0.1)
    assert len(told) == 1
