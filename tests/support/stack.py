"""`chat-appliance serve` over the synthetic upstream, as a black box: a real process on loopback.

The edge tests go through the real entry point (the supervisor's own server, with whatever
connection limits it sets) rather than an app served by the test, so that they hold whatever the
request path becomes. The synthetic upstream is the worker (`engine.command`), so a boot takes
about a second.
"""

from __future__ import annotations

import contextlib
import json
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psutil

from appliance.core.settings import Settings
from load.kit.appliance import first_event
from load.kit.isolation import clean_env
from load.kit.net import free_port
from load.kit.processes import terminate
from load.kit.procstat import Usage, usage
from load.kit.rawclient import Target
from tests.metrics_text import samples

ROOT = Path(__file__).resolve().parents[2]
BOOT_S = 60.0
STOP_S = 20.0


@dataclass
class Stack:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    engine_port: int
    # With server.tls_certfile: that certificate is the one trusted (https URLs).
    verify: ssl.SSLContext | bool = field(default=True, repr=False)
    # With server.api_keys: the first, for /health and /metrics (server.protect_ops_routes).
    headers: dict[str, str] = field(default_factory=dict, repr=False)

    @property
    def target(self) -> Target:
        return Target.parse(self.url)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def usage(self) -> Usage:
        return usage(self.proc.pid)

    def metrics(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return samples(httpx.get(f"{self.url}/metrics", timeout=10, verify=self.verify,
                                 headers=self.headers).text)

    def engine_counter(self, name: str) -> float:
        """A counter of the synthetic worker (synthetic_tokenize_calls_total, ...)."""
        text = httpx.get(f"http://127.0.0.1:{self.engine_port}/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(f"{name} "):
                return float(line.split()[1])
        raise AssertionError(f"the synthetic worker has no {name}")

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def quiet_log_length(self, quiet_s: float = 0.5, within_s: float = 5.0) -> int:
        """How many lines the log has once it has stopped growing (earlier requests' worker
        output may still be on its way in)."""
        return len(self.new_log_lines(0, quiet_s, within_s))

    def new_log_lines(self, since: int, quiet_s: float = 0.5, within_s: float = 5.0) -> list[str]:
        """The log lines after the first `since`, once the log has been quiet for `quiet_s`
        (the worker's output is pumped into it asynchronously)."""
        deadline = time.monotonic() + within_s
        lines = self.log_lines()
        while time.monotonic() < deadline:
            time.sleep(quiet_s)
            latest = self.log_lines()
            if len(latest) == len(lines):
                break
            lines = latest
        return lines[since:]

    def log_events(self) -> list[dict[str, object]]:
        events = []
        for line in self.log_lines():
            with contextlib.suppress(ValueError):
                event = json.loads(line)
                if isinstance(event, dict):
                    events.append(event)
        return events

    def wait_for_event(self, predicate: Callable[[dict[str, object]], bool],
                       within_s: float = 5.0) -> dict[str, object] | None:
        return first_event(self.log_events, predicate, within_s)

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_lines()[-lines:])


def known_settings(wanted: Mapping[str, object]) -> dict[str, object]:
    """`wanted` (dotted names, `server.idle_timeout_s`), once each name is checked against the
    Settings model: an environment variable naming no setting would be ignored without a word,
    and the test would pass without the setting it is about."""
    for key in wanted:
        group, _, name = key.partition(".")
        field = Settings.model_fields.get(group)
        model = getattr(field, "annotation", None)
        assert name in getattr(model, "model_fields", {}), f"{key} is not a setting"
    return dict(wanted)


def settings_env(wanted: Mapping[str, object]) -> dict[str, str]:
    """The CHAT_APPLIANCE_* variables for `wanted` (dotted names, checked)."""
    return {"CHAT_APPLIANCE_" + key.upper().replace(".", "__"):
            value if isinstance(value, str) else json.dumps(value)
            for key, value in known_settings(wanted).items()}


def _env(settings: Mapping[str, object], port: int, engine_port: int,
         upstream_args: Sequence[str]) -> dict[str, str]:
    upstream = [sys.executable, "-m", "load.kit.synthetic_worker", "--port",
                str(engine_port), "--tokens", "8", *upstream_args]
    env = clean_env()
    env |= {
        "CHAT_APPLIANCE_ENGINE__COMMAND": json.dumps(upstream),
        "CHAT_APPLIANCE_ENGINE__PORT": str(engine_port),
        "CHAT_APPLIANCE_ENGINE__LISTEN": "tcp",  # the synthetic upstream listens on TCP only
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
        "CHAT_APPLIANCE_SUPERVISOR__HEALTH_INTERVAL_S": "0.5",
        "CHAT_APPLIANCE_SUPERVISOR__DRAIN_TIMEOUT_S": "2",
        "CHAT_APPLIANCE_GPU__ENABLED": "false",
        "PYTHONPATH": str(ROOT),
    }
    return env | settings_env(settings)


@contextlib.contextmanager
def running_stack(log_dir: Path, settings: Mapping[str, object] | None = None,
                  upstream_args: Sequence[str] = ("--faults",)) -> Iterator[Stack]:
    """Boot serve over the synthetic worker, wait until /health is 200, stop both at the end."""
    port, engine_port = free_port(), free_port()
    log_path = log_dir / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.main", "serve"], cwd=ROOT,
                                env=_env(settings or {}, port, engine_port, upstream_args),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    cafile = (settings or {}).get("server.tls_certfile")
    verify = ssl.create_default_context(cafile=str(cafile)) if cafile else True
    keys = (settings or {}).get("server.api_keys") or []
    headers = {"Authorization": f"Bearer {keys[0]}"} if isinstance(keys, list) and keys else {}
    stack = Stack(f"{'https' if cafile else 'http'}://127.0.0.1:{port}", proc, log_path,
                  engine_port, verify, headers)
    try:
        _wait_ready(stack)
        yield stack
    finally:
        _stop(stack)


def _wait_ready(stack: Stack) -> None:
    deadline = time.monotonic() + BOOT_S
    while time.monotonic() < deadline:
        if stack.proc.poll() is not None:
            raise AssertionError(f"serve exited {stack.proc.returncode}:\n{stack.tail()}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{stack.url}/health", timeout=2, verify=stack.verify,
                         headers=stack.headers).status_code == 200:
                return
        time.sleep(0.1)
    raise AssertionError(f"appliance over the synthetic worker not ready:\n{stack.tail()}")


def _stop(stack: Stack) -> None:
    """SIGTERM (serve drains and stops its worker), then kill whatever of ours is left."""
    family = _family(stack.proc.pid)
    terminate(stack.proc, STOP_S)
    for process in family:
        with contextlib.suppress(psutil.Error):
            process.kill()


def _family(pid: int) -> list[psutil.Process]:
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []
