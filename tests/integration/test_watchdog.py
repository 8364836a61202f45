"""Watchdog depth against the real worker: a hung engine core, a graceful drain, sd_notify."""

from __future__ import annotations

import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from load.kit.appliance import Appliance, running_appliance, worker_tree

STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


def stream_lines(appliance: Appliance, max_tokens: int, lines: list[str],
                 started: threading.Event) -> None:
    body = {"messages": STORY, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{appliance.url}/v1/chat/completions", json=body,
                      timeout=180) as response:
        lines.append(f"status {response.status_code}")
        for line in response.iter_lines():
            if line:
                lines.append(line)
                started.set()


def start_stream(appliance: Appliance, max_tokens: int) -> tuple[threading.Thread, list[str]]:
    lines: list[str] = []
    started = threading.Event()
    thread = threading.Thread(target=stream_lines, args=(appliance, max_tokens, lines, started))
    thread.start()
    assert started.wait(60), f"the stream never started: {lines}"
    return thread, lines


def first_index(events: list[dict[str, object]], name: str) -> int:
    found = [i for i, event in enumerate(events) if event.get("event") == name]
    assert found, f"no {name} in the log"
    return found[0]


def engine_core(worker_pid: int) -> psutil.Process:
    """vLLM's EngineCore: the child of the API server that runs the model."""
    children = psutil.Process(worker_pid).children(recursive=True)
    cores = [p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name()]
    assert cores, f"no EngineCore among {[(p.pid, p.name()) for p in children]}"
    return cores[0]


def test_sigstopped_engine_core_is_declared_hung_and_restarted(tmp_path: Path) -> None:
    """/health stays 200 while EngineCore is stopped: the engine's own progress (its counters
    frozen and its CPU time still) tells, within seconds, and the frozen tree is killed."""
    stall, grace = 5.0, 5.0
    with running_appliance(  # resume off: the stream's end shows the hang (see test_resume.py)
        tmp_path, supervisor__hang_stall_s=str(stall), supervisor__stop_grace_s=str(grace),
        supervisor__health_timeout_s="30", resume__enabled="false",
    ) as appliance:
        booted_at = time.monotonic()
        old = int(appliance.wait_ready()["pid"])
        cold_start_s = time.monotonic() - booted_at
        thread, lines = start_stream(appliance, max_tokens=1500)
        core = engine_core(old)
        core.send_signal(signal.SIGSTOP)
        stopped_at = time.monotonic()
        while appliance.health().status_code == 200:
            assert time.monotonic() - stopped_at < 60, "the hang was never declared"
            time.sleep(0.2)
        detected_s = time.monotonic() - stopped_at
        thread.join(grace + 30)
        assert not thread.is_alive(), "the in-flight stream got no terminal answer"
        assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
        detail = appliance.wait_ready()
        recovered_s = time.monotonic() - stopped_at
        assert detail["last_exit"]["reason"] == "hung"  # type: ignore[index]
        assert "not running" in detail["last_exit"]["detail"]  # type: ignore[index]
        assert detail["pid"] != old
        assert not psutil.pid_exists(core.pid) or core.status() == psutil.STATUS_ZOMBIE
        assert not worker_tree(old)
        print(f"hang declared {detected_s:.1f} s after SIGSTOP, ready again after "
              f"{recovered_s:.1f} s (cold start {cold_start_s:.1f} s)")
        # A guard against the old bytes-and-canary watch (30 s + 20 s), with slack for a
        # loaded machine; the real number is printed and reported.
        assert detected_s < stall + 15


class NotifyListener:
    """systemd's side of sd_notify: a datagram socket read as messages arrive (the kernel
    queues only ~10 unread datagrams, as systemd's own reader would never let happen)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.messages: list[str] = []
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(str(path))
        self._sock.settimeout(0.2)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._done.is_set():
            try:
                self.messages.append(self._sock.recv(4096).decode())
            except TimeoutError:
                continue

    def close(self) -> str:
        self._done.set()
        self._thread.join(5)
        self._sock.close()
        return "\n".join(self.messages)


def test_sigterm_drains_a_stream_then_exits_0_and_notifies_systemd(tmp_path: Path) -> None:
    listener = NotifyListener(tmp_path / "notify.sock")
    env = {"NOTIFY_SOCKET": str(listener.path), "WATCHDOG_USEC": "2000000"}
    with running_appliance(tmp_path, env_extra=env,
                           supervisor__drain_timeout_s="120") as appliance:
        pid = int(appliance.wait_ready()["pid"])
        thread, lines = start_stream(appliance, max_tokens=200)
        appliance.proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert appliance.health().status_code == 503  # readiness drops at once
        refused = httpx.post(f"{appliance.url}/v1/chat/completions", timeout=10,
                             json={"messages": STORY, "max_tokens": 4})
        assert refused.status_code == 503 and "retry-after" in refused.headers
        thread.join(120)
        assert lines[0] == "status 200" and lines[-1] == "data: [DONE]"
        assert not any('"error"' in line for line in lines), "the stream finished cleanly"
        assert appliance.proc.wait(60) == 0
        assert not worker_tree(pid)
        events = appliance.log_events()
        stopping, drained = (first_index(events, name)
                             for name in ("supervisor.stopping", "supervisor.drained"))
        finished = [i for i, e in enumerate(events) if e.get("event") == "request.completed"
                    and e.get("status") == 200 and e.get("route") == "/v1/chat/completions"]
        assert len(finished) == 1 and stopping < finished[0] < drained, \
            "the stream was in flight when the drain began, and finished within it"
        assert events[drained]["left"] == 0 and events[drained]["forced"] is False
    sent = listener.close()
    for expected in ("READY=1", "STATUS=engine ready", "WATCHDOG=1", "STOPPING=1",
                     "STATUS=engine draining"):
        assert expected in sent, f"{expected} not among {listener.messages}"
    assert sent.index("READY=1") < sent.index("STOPPING=1")


@pytest.mark.long  # an appliance of its own for a 1,500-token stream cut short: about 25 s
def test_second_signal_forces_the_stop(tmp_path: Path) -> None:
    with running_appliance(tmp_path, supervisor__drain_timeout_s="300") as appliance:
        pid = int(appliance.wait_ready()["pid"])
        thread, _ = start_stream(appliance, max_tokens=1500)
        appliance.proc.send_signal(signal.SIGTERM)
        time.sleep(1)
        appliance.proc.send_signal(signal.SIGTERM)
        assert appliance.proc.wait(60) == 0
        thread.join(30)
        assert not worker_tree(pid)
        # The second signal ended the drain with the stream still in flight: an ignored one
        # would have let the stream finish (or the 300 s drain run out) first.
        events = appliance.log_events()
        drained = events[first_index(events, "supervisor.drained")]
        assert drained["forced"] is True and drained["left"] == 1, drained
        assert [e["count"] for e in events if e.get("event") == "supervisor.signal"] == [1, 2]
