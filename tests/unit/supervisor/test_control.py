"""Reload is the operator's alone: over the control socket (service user and root), never over
HTTP, so neither a web page on this machine nor a LAN caller behind a same-host proxy can do it."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from appliance.admission.clients import Roster
from appliance.app import create_app
from appliance.core.errors import ApiError
from appliance.core.settings import load_settings
from supervisor.operator.control import ask, control_socket, peer_uid
from supervisor.operator.reload import Reloader
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.anyio
NOBODY = 65534


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A Unix socket's path must fit in 108 bytes: pytest's tmp_path may not."""
    with tempfile.TemporaryDirectory(prefix="ca-ctl-") as name:
        yield Path(name)


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / "config.toml"
    path.write_text('[server]\napi_keys = ["sk-old"]\n')
    monkeypatch.setenv("CHAT_APPLIANCE_CONFIG", str(path))
    return path


@pytest.fixture
async def operator(short_dir: Path, config: Path) -> AsyncIterator[tuple[Path, Roster]]:
    """The supervisor's control socket, serving the reload as `serve` does."""
    clients = Roster.from_settings(load_settings())
    path = short_dir / "run" / "control.sock"
    async with control_socket(path, {"reload": Reloader(clients, None)}) as listening:
        assert listening
        yield path, clients


def write(path: Path, text: str) -> None:
    path.write_text(text)


def _known(clients: Roster, key: str) -> bool:
    try:
        clients.identify(f"Bearer {key}")
    except ApiError:
        return False
    return True


async def test_the_operator_reloads_over_the_socket_and_a_bad_file_keeps_what_is_in_force(
        operator: tuple[Path, Roster], config: Path) -> None:
    path, clients = operator
    write(config, '[server]\napi_keys = ["sk-new"]\n')
    answer = await asyncio.to_thread(ask, path, "reload")
    assert answer["ok"] is True and answer["keys"] == 1 and answer["generation"] == 2
    assert _known(clients, "sk-new") and not _known(clients, "sk-old")
    write(config, "[admission]\nqueue_max = -1\n")
    refused = await asyncio.to_thread(ask, path, "reload")
    assert refused["ok"] is False and refused["code"] == "bad_configuration"
    assert "admission.queue_max" in refused["error"]
    assert _known(clients, "sk-new") and clients.generation == 2


async def test_an_unknown_command_does_nothing(operator: tuple[Path, Roster]) -> None:
    path, clients = operator
    answer = await asyncio.to_thread(ask, path, "shutdown")
    assert answer["ok"] is False and answer["code"] == "unknown_command"
    assert clients.generation == 1


async def test_only_the_service_user_can_open_the_socket(operator: tuple[Path, Roster]) -> None:
    """Directory 0700, socket 0600; another user cannot even reach it."""
    path, clients = operator
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    if os.geteuid() != 0 or shutil.which("python3", path="/usr/bin") is None:
        pytest.skip("trying another user's access needs root and a system python3")
    tryout = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\n"
              "try:\n    s.connect(sys.argv[1])\nexcept PermissionError:\n    sys.exit(13)\n")
    # The system interpreter: another user may not be able to enter this venv's directory.
    result = await asyncio.to_thread(subprocess.run, ["/usr/bin/python3", "-c", tryout, str(path)],
                                     user=NOBODY, capture_output=True, timeout=30, check=False)
    assert result.returncode == 13, result.stderr
    assert clients.generation == 1


async def test_a_peer_of_another_uid_is_refused_even_where_the_modes_let_it_in(
        operator: tuple[Path, Roster]) -> None:
    """The uid check stands on its own: with the directory and the socket opened to everyone
    (a mode loosened by hand, an ACL), another user still gets no answer and reloads nothing."""
    path, clients = operator
    if os.geteuid() != 0 or shutil.which("python3", path="/usr/bin") is None:
        pytest.skip("connecting as another user needs root and a system python3")
    for folder in (path.parent.parent, path.parent):
        folder.chmod(0o755)
    path.chmod(0o666)
    # Closed unanswered: an empty read, a reset or a broken pipe, as the timing falls.
    tryout = ("import socket, sys\ns = socket.socket(socket.AF_UNIX)\ns.connect(sys.argv[1])\n"
              "try:\n    s.sendall(b'reload\\n')\n    answer = s.makefile('rb').readline()\n"
              "except ConnectionError:\n    answer = b''\nsys.exit(3 if answer else 0)\n")
    result = await asyncio.to_thread(subprocess.run, ["/usr/bin/python3", "-c", tryout, str(path)],
                                     user=NOBODY, capture_output=True, timeout=30, check=False)
    assert result.returncode == 0, result.stderr
    assert clients.generation == 1


async def test_the_uid_the_peer_check_reads_decides(short_dir: Path, config: Path) -> None:
    """Through the credential seam, wherever the tests run: a stranger's connection is closed
    unanswered, root's is served."""
    clients = Roster.from_settings(load_settings())
    seen: list[int] = []
    path = short_dir / "control.sock"
    async with control_socket(path, {"reload": Reloader(clients, None)},
                              peer=lambda _sock: seen.pop()) as listening:
        assert listening
        seen.append(NOBODY)
        with pytest.raises(ConnectionError):  # no answer: an empty read or a reset
            await asyncio.to_thread(ask, path, "reload")
        assert clients.generation == 1
        seen.append(0)
        assert (await asyncio.to_thread(ask, path, "reload"))["ok"] is True
        assert clients.generation == 2


async def test_the_peer_check_sees_who_connects() -> None:
    """SO_PEERCRED, the check behind the file modes: this process's own uid."""
    left, right = socket.socketpair(socket.AF_UNIX)
    with left, right:
        assert peer_uid(left) == os.geteuid()


async def test_a_socket_it_cannot_make_is_reported_and_the_appliance_goes_on(
        short_dir: Path) -> None:
    blocker = short_dir / "file"
    write(blocker, "")
    async with control_socket(blocker / "control.sock", {}) as listening:
        assert listening is False


async def test_a_link_in_place_of_the_directory_is_refused(short_dir: Path) -> None:
    """A per-user directory may lie in the shared /tmp: a link planted there is not ours,
    wherever it points (here at a directory this user owns)."""
    (short_dir / "real").mkdir()
    (short_dir / "run").symlink_to(short_dir / "real")
    async with control_socket(short_dir / "run" / "control.sock", {}) as listening:
        assert listening is False
    assert not (short_dir / "real" / "control.sock").exists()


async def test_no_web_request_reloads(config: Path) -> None:
    """A browser on this machine posting a cross-site form, and a LAN caller relayed by a
    same-host proxy that adds no forwarding header (both arrive from 127.0.0.1): neither
    reloads. There is no reload route at all."""
    settings = load_settings()
    clients = Roster.from_settings(settings)
    app = create_app(settings, FakeEngine("http://127.0.0.1:9"), clients=clients)
    write(config, '[server]\napi_keys = ["sk-attacker"]\n')
    form = {"content-type": "application/x-www-form-urlencoded",
            "origin": "http://evil.example", "referer": "http://evil.example/page"}
    transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
    async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as web:
        for path in ("/admin/reload", "/reload", "/admin/reload/"):
            for headers in (form, {}):
                response = await web.post(path, headers=headers, content=b"x=1")
                assert response.status_code in (401, 404), (path, response.status_code)
    assert clients.generation == 1
    assert _known(clients, "sk-old") and not _known(clients, "sk-attacker")
