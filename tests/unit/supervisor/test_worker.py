"""Worker process control with real processes: the whole session dies, frozen ones at once."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import psutil
import pytest

from appliance.settings import EngineSettings
from supervisor.exits import describe_exit
from supervisor.worker import ProcessLauncher, build_command, session_members

pytestmark = pytest.mark.anyio

# A "server" that starts a child (like vLLM's EngineCore) and ignores SIGTERM, as a busy
# vLLM waiting on an open stream effectively does.
TREE = ("import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
        "print('up', flush=True); time.sleep(600)")


async def start_tree() -> tuple[object, list[int]]:
    launcher = ProcessLauncher(EngineSettings(command=[sys.executable, "-c", TREE]))
    worker = await launcher.start()
    deadline = time.monotonic() + 10
    while len(session_members(worker.pid)) < 2:
        assert time.monotonic() < deadline, "the child never started"
        await asyncio.sleep(0.05)
    return worker, [p.pid for p in session_members(worker.pid)]


async def test_stop_escalates_to_sigkill_and_leaves_no_process_of_the_session() -> None:
    worker, pids = await start_tree()
    report = await worker.stop(grace_s=0.5)  # type: ignore[attr-defined]
    assert report.escalated
    assert report.returncode == -signal.SIGKILL
    assert not session_members(worker.pid)  # type: ignore[attr-defined]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)


async def test_frozen_worker_is_killed_without_waiting_the_grace() -> None:
    worker, pids = await start_tree()
    for pid in pids:
        psutil.Process(pid).suspend()
    # SIGSTOP lands asynchronously (a loaded machine shows it), and a parent caught waiting in
    # vfork for its stopped child stays in disk sleep: one stopped member is what stop() sees.
    deadline = time.monotonic() + 10
    while not any(psutil.Process(pid).status() == psutil.STATUS_STOPPED for pid in pids):
        assert time.monotonic() < deadline, "SIGSTOP never took effect"
        await asyncio.sleep(0.01)
    started = time.monotonic()
    report = await worker.stop(grace_s=30)  # type: ignore[attr-defined]
    assert time.monotonic() - started < 10
    assert report.escalated and not session_members(worker.pid)  # type: ignore[attr-defined]


def test_command_binds_loopback_and_uses_the_cpu_recipe() -> None:
    engine = EngineSettings(device="cpu", model="/m/SmolLM2", port=8123)
    argv = build_command(engine, [])
    assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in argv
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert argv[argv.index("--allowed-media-domains") + 1] == "none.invalid"
    assert "--enable-scale-out" in argv  # the render route the Responses budget is counted with


def test_exit_descriptions_name_the_signal_and_a_likely_cause() -> None:
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-9).startswith("SIGKILL (killed: out of memory")
