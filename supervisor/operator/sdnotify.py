"""The systemd notify protocol (sd_notify): READY, STATUS, WATCHDOG, STOPPING over a datagram."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)

# The variables systemd sets for the main process; a spawned worker must not inherit them.
ENV_VARS = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")


class Notifier:
    """Sends state lines to systemd's notify socket; every method is a no-op without one.

    A failed send is logged (`sdnotify.failed`) and reported as False, never raised:
    the supervisor loop must not die because systemd went away.
    """

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        watchdog_usec: int | None = None,
        watchdog_pid: int | None = None,
    ) -> None:
        self._address = _address(socket_path)
        self._watchdog_usec = watchdog_usec
        self._watchdog_pid = watchdog_pid
        self._sock: socket.socket | None = None

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Notifier:
        """Build from NOTIFY_SOCKET, WATCHDOG_USEC and WATCHDOG_PID (os.environ by default)."""
        env = os.environ if environ is None else environ
        return cls(
            env.get("NOTIFY_SOCKET") or None,
            watchdog_usec=_positive_int(env, "WATCHDOG_USEC"),
            watchdog_pid=_positive_int(env, "WATCHDOG_PID"),
        )

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def ready(self, status: str | None = None) -> bool:
        """READY=1: start-up is finished (the API listens); optionally with a STATUS line."""
        lines = ["READY=1"]
        if status is not None:
            lines.append(_status_line(status))
        return self.notify(*lines)

    def status(self, text: str) -> bool:
        """STATUS=...: one line shown by `systemctl status`."""
        return self.notify(_status_line(text))

    def watchdog(self) -> bool:
        """WATCHDOG=1: the keep-alive ping; send it only after the loop's own checks pass."""
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        """STOPPING=1: shutdown has begun."""
        return self.notify("STOPPING=1")

    def extend_timeout(self, seconds: float) -> bool:
        """EXTEND_TIMEOUT_USEC: ask for `seconds` more before the start (or stop) timeout fires."""
        usec = max(0, int(seconds * 1_000_000))
        return self.notify(f"EXTEND_TIMEOUT_USEC={usec}")

    def watchdog_interval_s(self) -> float | None:
        """How often to ping: half of WATCHDOG_USEC, if the watchdog is meant for this process."""
        if not self.enabled or self._watchdog_usec is None:
            return None
        if self._watchdog_pid is not None and self._watchdog_pid != os.getpid():
            return None
        return self._watchdog_usec / 2 / 1_000_000

    def notify(self, *lines: str) -> bool:
        """Send raw `KEY=VALUE` lines in one datagram; True when systemd got it."""
        if self._address is None:
            return False
        message = "\n".join(lines).encode()
        try:
            sock = self._socket()
            sock.sendto(message, self._address)
        except OSError as exc:
            log.warning(
                "sdnotify.failed",
                state=lines[0].split("=", 1)[0] if lines else "",
                error=str(exc),
                errno=exc.errno,
            )
            return False
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _socket(self) -> socket.socket:
        if self._sock is None:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            sock.setblocking(False)  # a full systemd queue must not stall the event loop
            self._sock = sock
        return self._sock


def _address(socket_path: str | None) -> str | None:
    """Filesystem path as is; `@name` is an abstract socket, whose address starts with NUL."""
    if not socket_path:
        return None
    if socket_path.startswith("/"):
        return socket_path
    if socket_path.startswith("@") and len(socket_path) > 1:
        return "\0" + socket_path[1:]
    log.warning("sdnotify.unsupported_socket", notify_socket=socket_path)
    return None


def _positive_int(env: Mapping[str, str], key: str) -> int | None:
    raw = env.get(key)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        log.warning("sdnotify.bad_env", key=key, value=raw)
        return None
    return value if value > 0 else None


def _status_line(text: str) -> str:
    # One datagram carries newline-separated assignments: a newline would end STATUS early.
    return "STATUS=" + " ".join(text.splitlines())
