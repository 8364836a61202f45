"""The operator's door: a Unix socket that only the service user reaches, for what no web page
may ever do (reload the keys and the certificate; drain the box and stop).

Not HTTP on the API port: a browser on this machine can send a form POST there, and behind a
same-host proxy every LAN caller looks local. A browser cannot open a Unix socket, and this one
lives in a 0700 directory, is 0600 itself, and checks its peer's uid (SO_PEERCRED): the
service user or root, nobody else.

The exchange is one line each way: a command (`reload`, `drain`), then one JSON object with `ok`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import stat
import struct
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any

import structlog

from supervisor.operator.private import private_dir

log = structlog.get_logger("supervisor.operator.control")

# One JSON object answers each command; a ControlRefused says why the action did not happen.
Action = Callable[[], dict[str, Any]]
PeerUid = Callable[[socket.socket | None], int | None]
COMMAND_LIMIT = 256  # bytes of one command line
READ_TIMEOUT_S = 5.0


def peer_uid(sock: socket.socket | None) -> int | None:
    """The uid of the process at the other end of a Unix socket (Linux SO_PEERCRED)."""
    if sock is None:
        return None
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


class ControlRefused(Exception):
    """The action was refused; `code` tells the caller what kind of refusal (exit status)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


@contextlib.asynccontextmanager
async def control_socket(path: Path, actions: Mapping[str, Action],
                         peer: PeerUid = peer_uid) -> AsyncIterator[bool]:
    """Serve `actions` on `path` while the block runs; yields False (and logs why) when the
    socket cannot be made, so that the appliance still serves (SIGHUP still reloads)."""
    try:
        _private_directory(path.parent)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a previous run's, or a crashed one's: this port is ours now
        server = await asyncio.start_unix_server(lambda r, w: _serve_one(r, w, actions, peer),
                                                 path=str(path), limit=COMMAND_LIMIT)
        os.chmod(path, 0o600)
    except OSError as exc:
        log.error("control.unavailable", path=str(path), error=exc.strerror or str(exc),
                  hint="reload with SIGHUP (kill -HUP) until server.control_socket is usable")
        yield False
        return
    log.info("control.listening", path=str(path))
    try:
        yield True
    finally:
        server.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _private_directory(directory: Path) -> None:
    """The socket's directory: ours, and entered by nobody else."""
    private_dir(directory)
    found = directory.lstat()  # a link planted in /tmp is not ours, whatever it points at
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        raise PermissionError(f"{directory} belongs to another user or is not a directory")
    os.chmod(directory, 0o700)


async def _serve_one(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                     actions: Mapping[str, Action], peer: PeerUid) -> None:
    try:
        uid = peer(writer.get_extra_info("socket"))
        if uid not in (os.geteuid(), 0):
            log.warning("control.refused_peer", uid=uid)
            return
        try:
            async with asyncio.timeout(READ_TIMEOUT_S):
                command = (await reader.readline()).decode("ascii", "replace").strip()
        except (TimeoutError, ValueError):  # ValueError: a line over COMMAND_LIMIT
            return
        writer.write(json.dumps(_run(command, actions)).encode() + b"\n")
        await writer.drain()
    except OSError as exc:
        log.info("control.peer_gone", error=exc.strerror or str(exc))
    finally:
        writer.close()


def _run(command: str, actions: Mapping[str, Action]) -> dict[str, Any]:
    action = actions.get(command)
    if action is None:
        return {"ok": False, "code": "unknown_command",
                "error": f"unknown command {command[:40]!r}; known: {', '.join(actions)}"}
    try:
        return {"ok": True} | action()
    except ControlRefused as exc:
        return {"ok": False, "code": exc.code, "error": str(exc)}


def ask(path: Path, command: str, timeout_s: float = 30.0) -> dict[str, Any]:
    """The operator's side (`chat-appliance reload`): send one command, read its answer.
    OSError when nothing answers there (or this user may not enter its directory)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(str(path))
        sock.sendall(command.encode("ascii") + b"\n")
        with sock.makefile("rb") as answer:
            line = answer.readline()
    if not line:
        raise ConnectionError(f"{path} closed without an answer (is this user allowed?)")
    result = json.loads(line)
    if not isinstance(result, dict):
        raise ValueError(f"{path} answered {line[:80]!r}")
    return result
