"""Start and stop a real `chat-appliance serve`: the real supervisor over the real vLLM CPU worker,
or over the synthetic worker (load.kit.synthetic_worker). The integration tests and the benches
that boot the appliance as tested both run it from here."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import httpx
import psutil

from appliance.core.sections import default_engine_python, default_model
from load.kit.isolation import clean_env
from load.kit.net import free_port
from supervisor.engine.stats import EngineStats, parse_engine_stats
from supervisor.engine.worker import session_members

ENGINE_BOOT_S = 300  # cold start is ~35 s on 2 cores; generous for a loaded CI machine
# A long answer (1500 tokens) takes minutes on 2 shared CPU cores: waiting longer means "never".
ENGINE_NEVER_S = 300
# Every process one appliance starts inherits this variable, with a value of its own: the
# supervisor copies its environment to the template and the workers, which each lead their own
# session (so neither the supervisor's session nor its children list finds them once it died).
TREE_MARKER = "APPLIANCE_TEST_TREE"
SESSION_LEADERS = ("template.starting", "worker.spawned", "worker.forked")


Event = dict[str, object]


def first_event(events: Callable[[], list[Event]], predicate: Callable[[Event], bool],
                within_s: float = 5.0) -> Event | None:
    """The first log event that satisfies `predicate`, polled for (a line about a request may
    be written just after its answer went out); None if none came in time."""
    deadline = time.monotonic() + within_s
    while True:
        found = next((event for event in events() if predicate(event)), None)
        if found is not None or time.monotonic() >= deadline:
            return found
        time.sleep(0.05)


@dataclass
class Appliance:
    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    engine_port: int
    marker: str
    engine_socket: Path | None = None  # the worker's Unix socket (None: it listens on TCP)

    def health(self) -> httpx.Response:
        return httpx.get(f"{self.url}/health", timeout=5)

    def engine_get(self, path: str, timeout_s: float = 10) -> httpx.Response:
        """GET straight from the worker, past the API (its /metrics, say)."""
        return self.engine_call("GET", path, timeout_s=timeout_s)

    def engine_call(self, method: str, path: str, timeout_s: float = 10,
                    **kwargs: object) -> httpx.Response:
        """A request straight to the worker, on its Unix socket or loopback port."""
        if self.engine_socket is None:
            transport, base = httpx.HTTPTransport(), f"http://127.0.0.1:{self.engine_port}"
        else:
            transport, base = httpx.HTTPTransport(uds=str(self.engine_socket)), "http://worker"
        with httpx.Client(transport=transport, base_url=base, timeout=timeout_s) as client:
            return client.request(method, path, **kwargs)  # type: ignore[arg-type]

    def worker_pid(self) -> int:
        return int(self.health().json()["pid"])

    def wait_ready(self, timeout_s: float = ENGINE_BOOT_S) -> dict[str, object]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited {self.proc.returncode}:\n{self.tail()}")
            with contextlib.suppress(httpx.HTTPError):
                response = self.health()
                if response.status_code == 200:
                    return dict(response.json())
            time.sleep(0.5)
        raise AssertionError(f"appliance not ready after {timeout_s}s:\n{self.tail()}")

    def log_events(self) -> list[dict[str, object]]:
        events = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                events.append(json.loads(line))
        return events

    def wait_for_event(self, predicate: Callable[[dict[str, object]], bool],
                       within_s: float = 5.0) -> dict[str, object] | None:
        return first_event(self.log_events, predicate, within_s)

    def engine_stats(self) -> EngineStats:
        """The worker's own counters (its /metrics), not the appliance's view of them."""
        text = self.engine_get("/metrics").text
        return parse_engine_stats(text)

    def generated_until_idle(self, before: EngineStats) -> float:
        """Tokens the engine generated since `before`, read once it runs no more requests than
        it did then: below a request's budget, the request was stopped short (aborted)."""
        deadline = time.monotonic() + ENGINE_NEVER_S
        while (now := self.engine_stats()).running > before.running:
            assert time.monotonic() < deadline, "the engine never stopped the request"
            time.sleep(0.05)
        return now.generation_tokens - before.generation_tokens

    def template_pid(self) -> int:
        started = [e for e in self.log_events() if e.get("event") == "template.starting"]
        assert started, "no template was started"
        return int(str(started[-1]["pid"]))

    def tree(self) -> list[psutil.Process]:
        """Every live process this appliance started, however deep, whatever its session:
        those carrying its marker and their descendants, and the members of every session its
        log names as started here (vLLM writes its process titles over the environment, so
        its server and EngineCore no longer show the marker, and they outlive their parent)."""
        found = {proc.pid: proc for proc in marked(self.marker)}
        for proc in list(found.values()):
            with contextlib.suppress(psutil.Error):
                found.update((child.pid, child) for child in proc.children(recursive=True))
        for sid, logged_at in self.session_leaders():
            members = session_members(sid)
            if _same_session(members, sid, logged_at):
                found.update((member.pid, member) for member in members)
        return list(found.values())

    def session_leaders(self) -> list[tuple[int, float]]:
        """(pid, when it was logged) of every template and worker this appliance started:
        each leads a session of its own."""
        return [(int(str(e["pid"])), datetime.fromisoformat(str(e["timestamp"])).timestamp())
                for e in self.log_events() if e.get("event") in SESSION_LEADERS]

    def tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(10)


def _same_session(members: list[psutil.Process], sid: int, logged_at: float) -> bool:
    """Whether the session `sid` is still the one that was logged. While a member lives the
    kernel keeps the number from being reused; a leader started after the log line is a new
    process that got the number again (pids wrap at 32768 here)."""
    for member in members:
        with contextlib.suppress(psutil.Error):
            if member.pid == sid and member.create_time() > logged_at + 1.0:
                return False
    return True


def marked(marker: str) -> list[psutil.Process]:
    """Live, non-zombie processes whose environment carries TREE_MARKER=marker."""
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if (proc.environ().get(TREE_MARKER) == marker
                    and proc.status() != psutil.STATUS_ZOMBIE):
                found.append(proc)
    return found


def start_serve(tmp_path: Path, env: dict[str, str], port: int, engine_port: int,
                cwd: Path | None = None, engine_socket: Path | None = None) -> Appliance:
    """`python -m supervisor.main serve` logging to tmp_path/serve.log, its tree marked."""
    marker = uuid.uuid4().hex
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.main", "serve"],
                                stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                env=env | {TREE_MARKER: marker})
    return Appliance(f"http://127.0.0.1:{port}", proc, log_path, engine_port, marker,
                     engine_socket)


@contextlib.contextmanager
def stopped_at_the_end(appliance: Appliance) -> Iterator[Appliance]:
    """Stop the appliance (SIGTERM, SIGKILL after a timeout), then kill whatever it left:
    a test that failed mid-way, or a stop that timed out, must not leak vLLM, EngineCore or
    the template into the rest of the run."""
    try:
        yield appliance
    finally:
        appliance.stop()
        left = appliance.tree()
        for member in left:
            with contextlib.suppress(psutil.Error):
                member.kill()
        psutil.wait_procs(left, timeout=10)  # a SIGKILL is delivered, not yet acted on


def require_engine() -> None:
    """The real engine is a prerequisite, not an option: say how to get it, don't skip."""
    python, model = default_engine_python(), Path(default_model())
    missing = [str(p) for p in (python, model / "config.json") if not p.exists()]
    if missing:
        raise AssertionError(f"engine not installed ({', '.join(missing)}): run `bash install.sh`")


@contextlib.contextmanager
def running_appliance(tmp_path: Path, env_extra: dict[str, str] | None = None,
                      **settings: str) -> Iterator[Appliance]:
    require_engine()
    port, engine_port = free_port(), free_port()
    # Short: a Unix socket's path has at most 107 bytes, and pytest's tmp_path can be longer.
    run_dir = Path(tempfile.mkdtemp(prefix="ca-run-"))
    env = clean_env()
    env |= {
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_ENGINE__PORT": str(engine_port),
        "CHAT_APPLIANCE_ENGINE__SOCKET_DIR": str(run_dir / "worker"),
        "CHAT_APPLIANCE_ENGINE__MAX_MODEL_LEN": "2048",
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
        "CHAT_APPLIANCE_SUPERVISOR__BACKOFF_INITIAL_S": "0.5",
        "CHAT_APPLIANCE_CRASHES__DIR": str(tmp_path / "crashes"),  # not the user's state dir
        "CHAT_APPLIANCE_CANARY__FILE": str(tmp_path / "canary.json"),  # nor its canary records
    }
    env |= {f"CHAT_APPLIANCE_{key.upper()}": value for key, value in settings.items()}
    env |= env_extra or {}
    tcp = env.get("CHAT_APPLIANCE_ENGINE__LISTEN") == "tcp"
    appliance = start_serve(tmp_path, env, port, engine_port,
                            engine_socket=None if tcp else run_dir / "worker" / "worker.sock")
    try:
        with stopped_at_the_end(appliance):
            yield appliance
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def as_client(who: str) -> dict[str, str]:
    """The headers of the named client `who`: its key in these tests is sk-<who>."""
    return {"Authorization": f"Bearer sk-{who}"}


@contextlib.contextmanager
def running_with_clients(tmp_path: Path, clients: Sequence[Mapping[str, object]],
                         **settings: str) -> Iterator[Appliance]:
    """The real appliance serving the named `clients`, once its worker is ready."""
    with running_appliance(tmp_path, None, admission__clients=json.dumps(clients),
                           **settings) as appliance:
        appliance.wait_ready()
        yield appliance


def chat_as(appliance: Appliance, who: str, body: Mapping[str, object]) -> httpx.Response:
    """A chat completion asked by the named client `who`."""
    return httpx.post(f"{appliance.url}/v1/chat/completions", timeout=120,
                      headers=as_client(who), json=body)


def long_stream(appliance: Appliance, messages: list[dict[str, str]],
                timeout_s: float, max_tokens: int = 1500) -> tuple[threading.Thread, list[str]]:
    """A chat stream of `max_tokens` (1,500: minutes here) read on a thread, its non-empty
    lines kept in the list; returned once the first line came."""
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        body = {"messages": messages, "max_tokens": max_tokens, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", f"{appliance.url}/v1/chat/completions", json=body,
                          timeout=timeout_s) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60), "the stream never started"
    return reader, lines


def worker_tree(pid: int) -> list[int]:
    """Live processes of the worker's session (the worker leads it)."""
    return [p.pid for p in session_members(pid)]


@contextlib.contextmanager
def running_synthetic_appliance(tmp_path: Path, *worker_args: str,
                                **settings: str) -> Iterator[Appliance]:
    """`serve` supervising the synthetic upstream instead of vLLM (fleet and proxy tests).

    The supervisor treats it as any worker: boot probes (/health, /v1/models, the 1-token
    canary), restarts, 503 while it is down. `worker_args` go to load.kit.synthetic_worker.
    """
    port, engine_port = free_port(), free_port()
    worker = [sys.executable, "-m", "load.kit.synthetic_worker",
              "--port", str(engine_port), *worker_args]
    env = clean_env()
    env |= {
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_ENGINE__PORT": str(engine_port),
        "CHAT_APPLIANCE_ENGINE__COMMAND": json.dumps(worker),
        "CHAT_APPLIANCE_ENGINE__LISTEN": "tcp",  # the synthetic upstream listens on TCP only
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
        "CHAT_APPLIANCE_CRASHES__DIR": str(tmp_path / "crashes"),
    }
    env |= {f"CHAT_APPLIANCE_{key.upper()}": value for key, value in settings.items()}
    # The worker inherits the checkout as its directory: `-m load.kit...` resolves there.
    appliance = start_serve(tmp_path, env, port, engine_port, Path(__file__).resolve().parents[2])
    with stopped_at_the_end(appliance):
        yield appliance
