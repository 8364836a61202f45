"""Where the worker listens: a Unix socket in a directory only the service user can enter.

The worker has no key of its own: whoever reaches it skips every rule of the gate. On loopback
TCP that is every process of every local user; on a socket in a mode-0700 directory it is the
service user alone. engine.listen = "tcp" keeps loopback TCP as a fallback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from appliance.fences.vllm import Flag
from supervisor.operator.private import private_dir

if TYPE_CHECKING:  # a type only: the GPU smoke check imports this without pydantic
    from appliance.core.sections import EngineSettings

log = structlog.get_logger("supervisor.engine.listen")

PORT_RELEASE_S = 10.0  # how long a start waits for the old worker's port
_SUN_PATH_MAX = 107  # bytes of a Unix socket path (108 with its terminating NUL, on Linux)


class ListenError(Exception):
    """The worker's socket directory cannot be made private: the worker must not start."""


def listen_flags(engine: EngineSettings) -> list[str]:
    """vLLM's flags for where the worker listens."""
    if engine.listen == "unix":
        return [Flag.UDS, str(engine.socket_path)]
    return [Flag.HOST, engine.host, Flag.PORT, str(engine.port)]


def prepare_socket_dir(engine: EngineSettings) -> None:
    """Make the socket's directory, mode 0700, owned by this user; refuse one that another user
    owns or that others may enter (a directory planted in /tmp, say), or a path too long."""
    if engine.listen != "unix":
        log.warning("engine.listen_tcp", host=engine.host, port=engine.port,
                    risk="every local user reaches the worker without a key")
        return
    path, directory = engine.socket_path, engine.resolved_socket_dir()
    if len(os.fsencode(path)) > _SUN_PATH_MAX:
        raise ListenError(f"socket path {path} is longer than {_SUN_PATH_MAX} bytes: "
                          "set engine.socket_dir to a shorter directory")
    private_dir(directory.parent)
    with contextlib.suppress(FileExistsError):
        directory.mkdir(mode=0o700)
    found = directory.lstat()
    if not stat.S_ISDIR(found.st_mode) or found.st_uid != os.geteuid():
        raise ListenError(f"{directory} is not a directory of this user's: refusing to put the "
                          "worker's socket there (set engine.socket_dir)")
    if stat.S_IMODE(found.st_mode) != 0o700:
        directory.chmod(0o700)  # ours, but too open: others could have reached the socket
    log.info("engine.listen_unix", socket=str(path))


async def listen_released(engine: EngineSettings) -> None:
    """Before a worker starts: nothing listens where it will (a killed tree closes its socket as
    it finishes exiting), and a Unix socket's leftover file is removed (vLLM's bind fails on
    it). One still served after the wait is left alone: it may be another supervisor's."""
    if engine.listen == "unix":
        path = engine.socket_path
        if await _released(lambda: not _accepting(path), str(path), PORT_RELEASE_S):
            with contextlib.suppress(FileNotFoundError):
                engine.socket_path.unlink()
        return
    await port_released(engine.host, engine.port)


async def port_released(host: str, port: int, timeout_s: float = PORT_RELEASE_S) -> bool:
    """Waits until nothing listens on the worker's port: a worker restarted at once after a
    kill can otherwise find its predecessor's socket still open and die on 'Address already
    in use'. False after timeout_s (logged); the start goes ahead and a failed boot is handled
    as any other."""
    return await _released(lambda: _bindable(host, port), f"{host}:{port}", timeout_s)


async def _released(free: Callable[[], bool], where: str, timeout_s: float) -> bool:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    waited = False
    while not free():
        if loop.time() >= deadline:
            log.warning("worker.listen_busy", where=where, waited_s=timeout_s)
            return False
        waited = True
        await asyncio.sleep(0.05)
    if waited:
        log.info("worker.listen_released", where=where)
    return True


def _accepting(path: Path) -> bool:
    """Something listens on the Unix socket at `path`. Never blocks: a full backlog (a server
    that stopped accepting) would hold a blocking connect, and the supervisor's loop with it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.setblocking(False)
        try:
            probe.connect(str(path))
        except BlockingIOError:  # listening, backlog full
            return True
        except OSError:  # no file, not a socket, or nobody listening: refused
            return False
    return True


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no obstacle
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True
