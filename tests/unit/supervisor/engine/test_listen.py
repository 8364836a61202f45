"""Where the worker listens: its private socket directory, the socket a start clears, the port
a TCP start waits for."""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import time
from pathlib import Path

import pytest
import structlog

from appliance.core.sections import EngineSettings
from supervisor.engine import listen
from supervisor.engine.listen import (
    ListenError,
    listen_released,
    port_released,
    prepare_socket_dir,
)

pytestmark = pytest.mark.anyio


def test_the_socket_directory_is_made_private_even_where_it_existed_open(tmp_path: Path) -> None:
    engine = EngineSettings(socket_dir=tmp_path / "run" / "worker")
    prepare_socket_dir(engine)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "worker").st_mode) == 0o700
    os.chmod(tmp_path / "run" / "worker", 0o755)  # ours, left open by a hand or an old version
    prepare_socket_dir(engine)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "worker").st_mode) == 0o700


def test_a_directory_that_is_not_ours_to_trust_is_refused(tmp_path: Path) -> None:
    """A symlink planted where the directory goes (in a shared /tmp, say) is not followed."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "worker").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ListenError, match="not a directory of this user's"):
        prepare_socket_dir(EngineSettings(socket_dir=tmp_path / "worker"))


def test_a_socket_path_too_long_for_the_kernel_is_refused_with_the_setting(tmp_path: Path) -> None:
    with pytest.raises(ListenError, match=r"engine\.socket_dir"):
        prepare_socket_dir(EngineSettings(socket_dir=tmp_path / ("d" * 120)))


def test_the_default_directory_is_one_per_engine_port_in_the_runtime_directory(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RUNTIME_DIRECTORY", str(tmp_path))
    engine = EngineSettings(port=8123)
    assert engine.socket_path == tmp_path / "chat-appliance-worker-8123" / "worker.sock"
    assert engine.base_url.startswith("http+unix://%2F")
    assert EngineSettings(port=8123, listen="tcp").base_url == "http://127.0.0.1:8123"


async def test_a_start_clears_the_old_workers_socket_file(tmp_path: Path) -> None:
    """vLLM binds its socket path and fails if a file is there: a killed worker leaves one."""
    engine = EngineSettings(socket_dir=tmp_path)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(engine.socket_path))
    stale.close()
    await listen_released(engine)
    assert not engine.socket_path.exists()
    await listen_released(engine)  # none there: nothing to do


async def test_a_socket_still_served_is_left_to_whoever_serves_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another supervisor's worker (same engine port) keeps its socket: this start's bind fails
    and says so, as on a busy TCP port, instead of taking the other's clients away. A holder
    that accepts nothing (its backlog fills with the checks) never blocks the check."""
    monkeypatch.setattr(listen, "PORT_RELEASE_S", 2.0)
    engine = EngineSettings(socket_dir=tmp_path)
    with socket.socket(socket.AF_UNIX) as held, structlog.testing.capture_logs() as logs:
        held.bind(str(engine.socket_path))
        held.listen(1)
        task = asyncio.create_task(listen_released(engine))
        await asyncio.sleep(0.2)
        assert not task.done()  # it waits for the holder first: a dying tree lets go soon
        await asyncio.wait_for(task, 30)
        assert engine.socket_path.exists()
    assert [e["event"] for e in logs] == ["worker.listen_busy"]


async def test_a_start_waits_for_the_old_workers_port_to_be_released() -> None:
    """A killed tree closes its listening socket as it finishes exiting; a worker started at
    once must not bind before that, or it dies on 'Address already in use'."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    asyncio.get_running_loop().call_later(0.3, listener.close)
    started = time.monotonic()
    assert await port_released("127.0.0.1", port, timeout_s=10)
    assert time.monotonic() - started >= 0.25
    holder = socket.create_server(("127.0.0.1", 0))
    with holder, structlog.testing.capture_logs() as logs:
        assert not await port_released("127.0.0.1", holder.getsockname()[1], timeout_s=0.2)
    assert [e["event"] for e in logs] == ["worker.listen_busy"]
