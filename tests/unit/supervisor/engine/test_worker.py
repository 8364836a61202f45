"""Worker process control with real processes: the whole session dies, frozen ones at once."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest
import structlog

from appliance.core.sections import EngineSettings
from supervisor.engine.exits import describe_exit
from supervisor.engine.worker import (
    ProcessLauncher,
    build_command,
    build_env,
    session_members,
)
from supervisor.serve import prepare_cache_dir

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


async def test_the_leftovers_of_a_dead_server_are_killed_without_waiting_the_grace() -> None:
    """kill -9 of vLLM's server leaves EngineCore running; there is nothing left for it to serve,
    so the restart does not wait stop_grace_s for it to shut down."""
    worker, pids = await start_tree()
    os.kill(worker.pid, signal.SIGKILL)  # type: ignore[attr-defined]
    await worker.wait()  # type: ignore[attr-defined]
    started = time.monotonic()
    report = await worker.stop(grace_s=30)  # type: ignore[attr-defined]
    assert time.monotonic() - started < 10
    assert report.escalated and not session_members(worker.pid)  # type: ignore[attr-defined]
    assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"
                   for pid in pids)


def test_command_listens_on_the_private_socket_and_uses_the_cpu_recipe(tmp_path: Path) -> None:
    engine = EngineSettings(device="cpu", model="/m/SmolLM2", port=8123, socket_dir=tmp_path)
    argv = build_command(engine, [])
    assert argv[1:3] == ["-m", "vllm.entrypoints.launchers.api_server.entry"]
    assert argv[argv.index("--uds") + 1] == str(tmp_path / "worker.sock")
    assert "--host" not in argv and "--port" not in argv  # no TCP listener at all
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert "--enforce-eager" in argv
    assert argv[argv.index("--distributed-executor-backend") + 1] == "uni"
    assert argv[argv.index("--allowed-media-domains") + 1] == "none.invalid"
    assert "--enable-scale-out" in argv  # the render route the Responses budget is counted with
    assert "--disable-uvicorn-access-log" in argv  # the appliance writes the access lines


def test_command_binds_loopback_tcp_only_where_the_fallback_is_chosen() -> None:
    argv = build_command(EngineSettings(device="cpu", model="/m/SmolLM2", port=8123,
                                        listen="tcp"), [])
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == "8123"
    assert "--uds" not in argv


def test_exit_descriptions_name_the_signal_and_a_likely_cause() -> None:
    assert describe_exit(1) == "exit 1"
    assert describe_exit(-9).startswith("SIGKILL (killed: out of memory")


def test_the_cache_root_outlives_the_worker_and_the_startup_plan_is_kept_on_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM keeps torch.compile, Inductor and Triton caches under VLLM_CACHE_ROOT: the supervisor
    sets it to one directory every start shares (the unit's XDG_CACHE_HOME by default)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "state-cache"))
    cpu = build_env(EngineSettings(device="cpu"))
    assert cpu["VLLM_CACHE_ROOT"] == str(tmp_path / "state-cache" / "vllm")
    assert "VLLM_ENABLE_STARTUP_PLAN" not in cpu  # the CPU never profiles GPU memory
    gpu = build_env(EngineSettings(device="cuda", cache_dir=tmp_path / "mine"))
    assert gpu["VLLM_CACHE_ROOT"] == str(tmp_path / "mine")
    assert gpu["VLLM_ENABLE_STARTUP_PLAN"] == "1"
    override = build_env(EngineSettings(device="cuda", env={"VLLM_ENABLE_STARTUP_PLAN": "0"}))
    assert override["VLLM_ENABLE_STARTUP_PLAN"] == "0"  # engine.env has the last word


def test_tritons_cache_is_under_the_cache_root_too(tmp_path: Path) -> None:
    """vLLM moves Triton's cache under its root only once it compiles a graph; its own Triton
    kernels would go to ~/.triton, outside engine.cache_dir and the unit's ReadWritePaths."""
    env = build_env(EngineSettings(device="cuda", cache_dir=tmp_path / "mine"))
    assert env["TRITON_CACHE_DIR"] == str(tmp_path / "mine" / "triton")


def test_usage_statistics_stay_on_the_lan_unless_the_operator_says_otherwise() -> None:
    env = build_env(EngineSettings(device="cpu"))
    assert (env["VLLM_NO_USAGE_STATS"], env["DO_NOT_TRACK"]) == ("1", "1")
    allowed = build_env(EngineSettings(device="cpu", env={"VLLM_NO_USAGE_STATS": "0",
                                                          "DO_NOT_TRACK": "0"}))
    assert (allowed["VLLM_NO_USAGE_STATS"], allowed["DO_NOT_TRACK"]) == ("0", "0")


def test_the_worker_downloads_nothing_and_follows_no_media_redirect(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker reads local model directories only, and vLLM's media fetch follows no
    redirect (the gate's SSRF check cannot vet where one leads), whatever the parent's
    environment says: these are vLLM's and Hugging Face's own variable names."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        monkeypatch.setenv(name, "0")
    monkeypatch.setenv("VLLM_MEDIA_URL_ALLOW_REDIRECTS", "1")
    for device in ("cpu", "cuda"):
        env = build_env(EngineSettings(device=device))
        assert (env["HF_HUB_OFFLINE"], env["TRANSFORMERS_OFFLINE"],
                env["VLLM_MEDIA_URL_ALLOW_REDIRECTS"]) == ("1", "1", "0"), device


def test_an_unwritable_cache_root_is_a_warning_that_names_it(tmp_path: Path) -> None:
    (tmp_path / "a-file").write_text("")
    with structlog.testing.capture_logs() as logs:
        assert not prepare_cache_dir(tmp_path / "a-file" / "vllm")
        assert prepare_cache_dir(tmp_path / "cache" / "vllm")
    assert (tmp_path / "cache" / "vllm").is_dir()
    warning, info = logs
    assert warning["event"] == "engine.cache_unwritable" and warning["log_level"] == "warning"
    assert warning["path"] == str(tmp_path / "a-file" / "vllm")
    assert info["event"] == "engine.cache_dir"
