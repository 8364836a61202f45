"""An appliance of the self-test's own: the operator's settings on free loopback ports, its
sockets, crash bundles and log in a temporary directory; stopped at the end, and every process
it started accounted for."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from supervisor.engine.worker import session_members

# Log events naming a process that leads a session of its own (vLLM's tree under each).
SESSION_LEADERS = ("template.starting", "worker.spawned", "worker.forked")
STOP_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Instance:
    url: str
    api_key: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    left_behind: list[str] = field(default_factory=list)  # filled once it is stopped
    sessions: int = 0  # the process sessions it started (the template's, each worker's)

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def session_leaders(self) -> set[int]:
        found = set()
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError, KeyError, TypeError):
                event = json.loads(line)
                if event.get("event") in SESSION_LEADERS:
                    found.add(int(event["pid"]))
        return found


def instance_env(run_dir: Path, port: int, engine_port: int, api_key: str) -> dict[str, str]:
    """The caller's environment (its configuration file, its engine and model) with this
    instance's own ports, directories and key, and JSON logs the self-test reads."""
    return dict(os.environ) | {
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__API_KEYS": json.dumps([api_key]),
        "CHAT_APPLIANCE_SERVER__CONTROL_SOCKET": str(run_dir / "control.sock"),
        "CHAT_APPLIANCE_ENGINE__PORT": str(engine_port),
        "CHAT_APPLIANCE_ENGINE__SOCKET_DIR": str(run_dir / "worker"),
        "CHAT_APPLIANCE_CRASHES__DIR": str(run_dir / "crashes"),
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
    }


@contextlib.contextmanager
def temporary_instance() -> Iterator[Instance]:
    """`chat-appliance serve` on free ports until the block ends; then stopped (SIGTERM, then
    SIGKILL), and whatever it left killed and named in `left_behind`."""
    # Short: a Unix socket's path has at most 107 bytes.
    run_dir = Path(tempfile.mkdtemp(prefix="ca-selftest-"))
    port, api_key = free_port(), secrets.token_urlsafe(24)
    log_path = run_dir / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.main", "serve"],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env=instance_env(run_dir, port, free_port(), api_key))
    instance = Instance(f"http://127.0.0.1:{port}", api_key, proc, log_path)
    try:
        yield instance
    finally:
        instance.left_behind = _stop(instance)
        shutil.rmtree(run_dir, ignore_errors=True)


def _stop(instance: Instance) -> list[str]:
    """Stop the instance as systemd would; returns what outlived it (then killed)."""
    proc = instance.proc
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
    leaders = instance.session_leaders()
    instance.sessions = len(leaders)
    left = {member.pid: member for sid in leaders | {proc.pid}
            for member in session_members(sid)}
    named = []
    for member in left.values():
        with contextlib.suppress(psutil.Error):
            named.append(f"{member.pid} {member.name()}")
            member.kill()
    psutil.wait_procs(list(left.values()), timeout=10)
    return named
