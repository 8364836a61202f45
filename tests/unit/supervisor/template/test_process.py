"""Workers forked from a real template process (this venv's Python, a stand-in worker module):
supervised like spawned ones, and spawned instead whenever the template cannot serve."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import psutil
import pytest
from structlog.testing import capture_logs

from appliance.core.sections import EngineSettings
from supervisor.engine.launcher import TemplateLauncher, build_launcher
from supervisor.engine.worker import ProcessLauncher, SessionWorker, WorkerProcess, session_members
from supervisor.template.process import EXIT_REPORT_GRACE_S, EXIT_UNKNOWN, ForkedWorker

pytestmark = pytest.mark.anyio

TREE = [sys.executable, "-m", "tests.support.tree_worker"]
REPO = str(Path(__file__).resolve().parents[4])  # where a template finds a stand-in preload


def engine(*args: str, python: str = sys.executable, **env: str) -> EngineSettings:
    return EngineSettings(python=python, command=[python, *TREE[1:], *args], env=env)


@pytest.fixture
async def launchers() -> AsyncIterator[Callable[..., TemplateLauncher]]:
    """TemplateLaunchers preloading only `json`, all closed (templates ended) after the test."""
    made: list[TemplateLauncher] = []

    def make(settings: EngineSettings, preloads: list[str] | None = None) -> TemplateLauncher:
        made.append(TemplateLauncher(settings, preloads=preloads or ["json"]))
        return made[-1]

    yield make
    for launcher in made:
        await launcher.aclose()


async def until(check: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


def outputs(logs: list[dict[str, Any]], stream: str) -> list[str]:
    return [e["line"] for e in logs if e["event"] == "worker.output" and e["stream"] == stream]


async def first_report(logs: list[dict[str, Any]]) -> dict[str, Any]:
    await until(lambda: bool(outputs(logs, "stdout")) and bool(outputs(logs, "stderr")))
    return dict(json.loads(outputs(logs, "stdout")[0]))


async def stopped(worker: SessionWorker) -> None:
    await worker.stop(0.5)
    assert not session_members(worker.pid)


async def test_a_forked_worker_keeps_what_the_preloads_set_in_the_environment(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """A spawned worker imports vLLM and so has what that import sets (TORCHINDUCTOR_COMPILE_
    THREADS, TRITON_CACHE_AUTOTUNING, ...): a forked one must have it too."""
    launcher = launchers(engine("--env", "CHAT_APPLIANCE_SET_ON_IMPORT", PYTHONPATH=REPO),
                         preloads=["tests.support.sets_env_on_import"])
    with capture_logs() as logs:
        worker = await launcher.start()
        report = await first_report(logs)
    assert isinstance(worker, ForkedWorker)
    assert report["env"] == "by-the-import"
    await stopped(worker)


async def test_forked_worker_runs_as_python_m_would_in_a_session_of_its_own(
        launchers: Callable[..., TemplateLauncher], tmp_path: Path) -> None:
    """argv, env, cwd, its own session and group, stdin /dev/null, both streams re-emitted."""
    launcher = launchers(engine("--env", "MARK", MARK="from-settings"))
    with capture_logs() as logs:
        worker = await launcher.start()
        report = await first_report(logs)
    assert isinstance(worker, ForkedWorker)
    assert worker.pid != launcher.template.proc.pid  # type: ignore[union-attr]
    assert report["argv"][1:] == ["--env", "MARK"] and report["argv"][0].endswith("tree_worker.py")
    assert report["main"] == "__main__" and report["cwd"] == os.getcwd()
    assert report["leads_session"] and report["leads_group"] and report["stdin_is_devnull"]
    assert report["env"] == "from-settings"
    assert outputs(logs, "stderr") == ["tree_worker stderr line"]
    assert all(e["source"] == "worker" for e in logs if e["event"] == "worker.output")
    await stopped(worker)


async def test_exit_status_comes_from_the_template_at_once(
        launchers: Callable[..., TemplateLauncher]) -> None:
    launcher = launchers(engine("--exit", "3"))
    worker = await launcher.start()
    assert await asyncio.wait_for(worker.wait(), 5) == 3
    assert worker.returncode == 3
    launcher._engine = engine()  # a worker that stays up, for a kill -9
    worker = await launcher.start()
    await until(lambda: bool(session_members(worker.pid)))
    os.kill(worker.pid, signal.SIGKILL)
    assert await asyncio.wait_for(worker.wait(), 5) == -signal.SIGKILL


async def test_stop_escalates_and_leaves_no_process_of_the_forked_session(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """A server that ignores SIGTERM, with a child like EngineCore: the whole session dies."""
    worker = await launchers(engine("--child", "--ignore-term")).start()
    await until(lambda: len(session_members(worker.pid)) == 2)
    pids = [p.pid for p in session_members(worker.pid)]
    report = await worker.stop(grace_s=0.5)
    assert report.escalated and report.returncode == -signal.SIGKILL
    assert not session_members(worker.pid)
    assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in pids)


async def test_a_template_that_cannot_import_its_preloads_means_spawn_and_why(
        launchers: Callable[..., TemplateLauncher]) -> None:
    launcher = launchers(engine("--exit", "0"), preloads=["no_such_module_for_the_template"])
    with capture_logs() as logs:
        worker = await launcher.start()
    assert isinstance(worker, WorkerProcess)
    fallback = [e for e in logs if e["event"] == "worker.spawn_fallback"]
    assert fallback and "no_such_module_for_the_template" in fallback[0]["reason"]
    assert await worker.wait() == 0


async def test_a_template_whose_preloads_initialised_cuda_means_spawn_and_why(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """A child forked after CUDA's initialisation cannot use the GPU: the template says so."""
    launcher = launchers(engine("--exit", "0", PYTHONPATH=REPO),
                         preloads=["tests.support.cuda_initialised_torch"])
    with capture_logs() as logs:
        worker = await launcher.start()
    assert isinstance(worker, WorkerProcess)
    fallback = [e for e in logs if e["event"] == "worker.spawn_fallback"]
    assert fallback and "the preloads initialised CUDA (torch.cuda.is_initialized() is true)" \
        in fallback[0]["reason"]
    assert await worker.wait() == 0


async def test_a_template_whose_threads_hang_a_forked_child_means_spawn_and_why(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """A preload left a pool whose lock a forked child cannot take (torch's OpenMP pool once it
    has run): the trial fork at boot finds the child hanging, and workers are spawned."""
    settings = engine("--exit", "0", PYTHONPATH=REPO).model_copy(
        update={"template_fork_timeout_s": 1.0})
    launcher = launchers(settings, preloads=["tests.support.pool_locked_in_child"])
    with capture_logs() as logs:
        worker = await launcher.start()
    assert isinstance(worker, WorkerProcess)
    fallback = [e for e in logs if e["event"] == "worker.spawn_fallback"]
    assert fallback and "a child forked from the template hung for 1s" in fallback[0]["reason"]
    assert await worker.wait() == 0


async def test_repeated_template_failures_give_the_template_up(
        launchers: Callable[..., TemplateLauncher]) -> None:
    launcher = launchers(engine("--exit", "0"), preloads=["no_such_module_for_the_template"])
    with capture_logs() as logs:
        for _ in range(4):
            await (await launcher.start()).wait()
            await until(lambda: launcher._booting is None)
    assert [e for e in logs if e["event"] == "template.disabled"]
    assert "gave up after 3 failures" in [e for e in logs
                                          if e["event"] == "worker.spawn_fallback"][-1]["reason"]


async def test_a_refused_start_is_spawned_instead(launchers: Callable[..., TemplateLauncher],
                                                  tmp_path: Path) -> None:
    """The template only runs its own interpreter: another argv[0] is refused, then spawned."""
    other = tmp_path / "python"
    other.symlink_to(sys.executable)
    settings = engine("--exit", "0")
    settings.command = [str(other), *TREE[1:], "--exit", "0"]
    with capture_logs() as logs:
        worker = await launchers(settings).start()
    assert isinstance(worker, WorkerProcess)
    reason = next(e for e in logs if e["event"] == "worker.spawn_fallback")["reason"]
    assert "not this template's interpreter" in reason
    assert await worker.wait() == 0


async def test_a_dead_template_is_replaced_before_the_next_start(
        launchers: Callable[..., TemplateLauncher]) -> None:
    launcher = launchers(engine("--exit", "0"))
    await (await launcher.start()).wait()
    first = launcher.template
    assert first is not None
    first.proc.kill()
    await until(lambda: launcher.template is not None and launcher.template is not first)
    worker = await launcher.start()
    assert isinstance(worker, ForkedWorker)
    assert launcher.template.proc.pid != first.proc.pid  # type: ignore[union-attr]


async def test_a_changed_engine_venv_replaces_the_template(
        launchers: Callable[..., TemplateLauncher], tmp_path: Path) -> None:
    python = tmp_path / "python"  # the engine venv's interpreter link
    python.symlink_to(sys.executable)
    launcher = launchers(engine("--exit", "0", python=str(python)))
    await (await launcher.start()).wait()
    first = launcher.template
    os.utime(python, ns=(time.time_ns(), time.time_ns() + 10**9), follow_symlinks=False)
    with capture_logs() as logs:
        worker = await launcher.start()
    assert isinstance(worker, ForkedWorker)
    assert launcher.template is not first
    assert [e["reason"] for e in logs if e["event"] == "template.retired"] == ["engine venv changed"]


async def test_a_worker_outliving_its_template_is_still_seen_to_exit(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """No template left to reap it: the pidfd sees the exit; the status is marked lost."""
    launcher = launchers(engine())
    worker = await launcher.start()
    await until(lambda: bool(session_members(worker.pid)))
    template = launcher.template
    assert template is not None
    template.proc.kill()
    await template.died()
    os.kill(worker.pid, signal.SIGKILL)
    assert await asyncio.wait_for(worker.wait(), EXIT_REPORT_GRACE_S + 5) == EXIT_UNKNOWN


def test_the_template_applies_to_vllm_only_and_can_be_turned_off() -> None:
    assert isinstance(build_launcher(EngineSettings(device="cpu")), TemplateLauncher)
    assert isinstance(build_launcher(EngineSettings(template="off")), ProcessLauncher)
    assert isinstance(build_launcher(EngineSettings(command=TREE)), ProcessLauncher)


async def test_closing_the_launcher_leaves_no_worker_of_its_template(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """Whatever the manager did or did not stop, the template takes its workers with it."""
    launcher = launchers(engine("--child"))
    worker = await launcher.start()
    await until(lambda: len(session_members(worker.pid)) == 2)
    await launcher.aclose()
    await until(lambda: not session_members(worker.pid))


async def test_a_worker_forked_for_a_start_that_was_cancelled_is_killed(
        launchers: Callable[..., TemplateLauncher]) -> None:
    launcher = launchers(engine())
    await (await launcher.start()).stop(0.5)  # the template is ready now
    template = launcher.template
    assert template is not None
    with capture_logs() as logs:
        forking = asyncio.create_task(template.fork(TREE, os.getcwd(), 10))
        await asyncio.sleep(0)  # the request is sent; the reply is not read yet
        forking.cancel()
        await until(lambda: any(e["event"] == "worker.abandoned" for e in logs))
    pid = next(e["pid"] for e in logs if e["event"] == "worker.abandoned")
    await until(lambda: not session_members(pid))


async def test_a_changed_worker_environment_replaces_the_template(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """The template imported under the old environment: its modules may have read it."""
    launcher = launchers(engine("--exit", "0", MARK="one"))
    await (await launcher.start()).wait()
    launcher._engine = engine("--exit", "0", MARK="two")
    with capture_logs() as logs:
        worker = await launcher.start()
    assert isinstance(worker, ForkedWorker) and await worker.wait() == 0
    assert [e["reason"] for e in logs if e["event"] == "template.retired"] == [
        "worker environment changed"]


@pytest.mark.parametrize("anyio_backend", [pytest.param(("asyncio", {"use_uvloop": True}),
                                                        id="uvloop")])
async def test_on_the_serving_loop_the_template_ends_at_end_of_file_not_by_sigkill(
        launchers: Callable[..., TemplateLauncher]) -> None:
    """uvloop (the loop `serve` runs on) keeps a descriptor with a read pending on it open
    after close(): the template must still see the end of its channel and exit by itself."""
    launcher = launchers(engine())
    worker = await launcher.start()
    template = launcher._template
    assert template is not None
    await stopped(worker)
    await launcher.aclose()
    assert template.proc.returncode == 0, "killed after the grace: no end of file reached it"
