"""sd_notify against a real unix datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from supervisor.operator.sdnotify import ENV_VARS, Notifier


class Systemd:
    """The receiving end of NOTIFY_SOCKET."""

    def __init__(self, sock: socket.socket, notify_socket: str) -> None:
        self.sock = sock
        self.notify_socket = notify_socket

    def receive(self) -> str:
        return self.sock.recv(4096).decode()

    def nothing_pending(self) -> bool:
        self.sock.setblocking(False)
        try:
            self.sock.recv(4096)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(2.0)
        return False


def _receiver(address: str, notify_socket: str) -> Iterator[Systemd]:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(2.0)  # a bound on a missing datagram, not a sleep
    try:
        yield Systemd(sock, notify_socket)
    finally:
        sock.close()


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[Systemd]:
    path = str(tmp_path / "notify.sock")
    yield from _receiver(path, path)


@pytest.fixture
def abstract_systemd() -> Iterator[Systemd]:
    name = f"chat-appliance-test-{uuid.uuid4().hex}"
    yield from _receiver("\0" + name, "@" + name)


def test_ready_sends_ready_1(systemd: Systemd) -> None:
    notifier = Notifier(systemd.notify_socket)
    assert notifier.ready() is True
    assert systemd.receive() == "READY=1"


def test_ready_with_status_is_one_datagram(systemd: Systemd) -> None:
    Notifier(systemd.notify_socket).ready(status="engine ready")
    assert systemd.receive() == "READY=1\nSTATUS=engine ready"


def test_status_line_is_kept_on_one_line(systemd: Systemd) -> None:
    Notifier(systemd.notify_socket).status("engine starting\nloading model")
    assert systemd.receive() == "STATUS=engine starting loading model"


def test_watchdog_stopping_and_extend_timeout(systemd: Systemd) -> None:
    notifier = Notifier(systemd.notify_socket)
    notifier.watchdog()
    notifier.stopping()
    notifier.extend_timeout(90.5)
    assert systemd.receive() == "WATCHDOG=1"
    assert systemd.receive() == "STOPPING=1"
    assert systemd.receive() == "EXTEND_TIMEOUT_USEC=90500000"


def test_abstract_socket_name_gets_a_leading_nul(abstract_systemd: Systemd) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": abstract_systemd.notify_socket})
    assert notifier.enabled
    assert notifier.ready() is True
    assert abstract_systemd.receive() == "READY=1"


def test_from_env_reads_os_environ(systemd: Systemd, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", systemd.notify_socket)
    Notifier.from_env().status("hello")
    assert systemd.receive() == "STATUS=hello"


def test_without_notify_socket_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ENV_VARS:
        monkeypatch.delenv(key, raising=False)
    notifier = Notifier.from_env()
    assert not notifier.enabled
    assert notifier.ready() is False
    assert notifier.status("x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.extend_timeout(10) is False
    assert notifier.watchdog_interval_s() is None


def test_unsupported_socket_form_disables_the_notifier() -> None:
    assert not Notifier("vsock:2:1234").enabled


def test_send_error_is_swallowed_and_reported(tmp_path: Path) -> None:
    """systemd gone (nobody bound to the path): logged and False, never raised."""
    notifier = Notifier(str(tmp_path / "nobody-listens.sock"))
    assert notifier.enabled
    assert notifier.watchdog() is False


def test_send_error_is_logged(tmp_path: Path) -> None:
    with capture_logs() as logs:
        Notifier(str(tmp_path / "gone.sock")).ready()
    assert [entry["event"] for entry in logs] == ["sdnotify.failed"]
    assert logs[0]["state"] == "READY"


def test_full_receive_queue_does_not_block(systemd: Systemd) -> None:
    """The send is non-blocking: a receiver that never reads cannot stall the loop."""
    notifier = Notifier(systemd.notify_socket)
    results = [notifier.status("x" * 1024) for _ in range(10_000)]
    assert results[0] is True
    assert False in results  # the queue filled up and the send failed instead of blocking


def test_close_then_send_reopens(systemd: Systemd) -> None:
    notifier = Notifier(systemd.notify_socket)
    notifier.watchdog()
    notifier.close()
    notifier.watchdog()
    assert systemd.receive() == "WATCHDOG=1"
    assert systemd.receive() == "WATCHDOG=1"
    assert systemd.nothing_pending()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"WATCHDOG_USEC": "30000000"}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}, 15.0),
        ({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
        ({}, None),
    ],
)
def test_watchdog_interval_is_half_of_watchdog_usec_for_this_pid(
    env: dict[str, str], expected: float | None
) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": "/run/systemd/notify", **env})
    assert notifier.watchdog_interval_s() == expected


def test_watchdog_interval_needs_a_notify_socket() -> None:
    assert Notifier.from_env({"WATCHDOG_USEC": "30000000"}).watchdog_interval_s() is None


def test_explicit_arguments_need_no_environment() -> None:
    notifier = Notifier("/run/systemd/notify", watchdog_usec=2_000_000, watchdog_pid=os.getpid())
    assert notifier.watchdog_interval_s() == 1.0
