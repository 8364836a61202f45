"""Key rotation without a restart, on the real `serve` (synthetic worker: the engine is not
under test): `chat-appliance reload` and SIGHUP swap the clients table, a request in flight
under the old key finishes, and a broken file keeps the old table and says why."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import Appliance, running_synthetic_appliance
from load.kit.isolation import clean_env

pytestmark = pytest.mark.synthetic  # no vLLM: the synthetic worker

OLD, NEW, NEWER = "sk-old-key", "sk-new-key", "sk-newer-key"


def config_with(path: Path, key: str) -> None:
    path.write_text(f'[[admission.clients]]\nname = "app"\nkey = "{key}"\nmax_inflight = 4\n')


@pytest.fixture(scope="module")
def rotating(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, Path]]:
    workdir = Path(tmp_path_factory.mktemp("reload"))
    config = workdir / "config.toml"
    config_with(config, OLD)
    with running_synthetic_appliance(workdir, "--tokens", "40", "--token-delay", "0.25",
                                     config=str(config)) as appliance:
        appliance.wait_ready(60)
        yield appliance, config


def status(appliance: Appliance, key: str) -> int:
    return httpx.get(f"{appliance.url}/v1/models", timeout=10,
                     headers={"Authorization": f"Bearer {key}"}).status_code


def reload_command(appliance: Appliance, config: Path) -> subprocess.CompletedProcess[str]:
    env = clean_env()
    env |= {"CHAT_APPLIANCE_CONFIG": str(config),
            "CHAT_APPLIANCE_SERVER__PORT": appliance.url.rsplit(":", 1)[1]}
    return subprocess.run([sys.executable, "-m", "supervisor.main", "reload"], env=env,
                          capture_output=True, text=True, timeout=30, check=False)


def eventually(condition: object, within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_reload_command_rotates_the_key_and_the_request_in_flight_finishes(
        rotating: tuple[Appliance, Path]) -> None:
    appliance, config = rotating
    assert status(appliance, OLD) == 200
    lines: list[str] = []
    started = threading.Event()

    def stream() -> None:  # 40 tokens at 250 ms: about 10 s, across the reload
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 40, "stream": True}
        with httpx.stream("POST", f"{appliance.url}/v1/chat/completions", json=body, timeout=30,
                          headers={"Authorization": f"Bearer {OLD}"}) as response:
            for line in response.iter_lines():
                started.set()
                if line:
                    lines.append(line)

    in_flight = threading.Thread(target=stream)
    in_flight.start()
    assert started.wait(10)
    config_with(config, NEW)
    result = reload_command(appliance, config)
    assert result.returncode == 0, result.stderr
    assert "clients app" in result.stdout
    assert status(appliance, OLD) == 401 and status(appliance, NEW) == 200
    in_flight.join(30)
    assert len(lines) == 42 and lines[-1] == "data: [DONE]"  # the role's event, 40 tokens
    # In order: the new table was in force before the old key's stream finished.
    # The request's line is written just after its answer went out: wait for it.
    def finished_ok(e: dict[str, object]) -> bool:
        return (e.get("event") == "request.completed"
                and e.get("route") == "/v1/chat/completions" and e.get("status") == 200)

    assert appliance.wait_for_event(finished_ok) is not None
    events = appliance.log_events()
    reloaded = next(i for i, e in enumerate(events) if e.get("event") == "clients.reloaded")
    finished = next(i for i, e in enumerate(events) if finished_ok(e))
    assert reloaded < finished, "the stream had finished before the reload: nothing was in flight"


def test_a_broken_file_keeps_the_clients_in_force_and_says_why(
        rotating: tuple[Appliance, Path]) -> None:
    appliance, config = rotating
    config_with(config, NEW)
    assert reload_command(appliance, config).returncode == 0
    good = config.read_text()
    config.write_text(good.replace("max_inflight = 4", "max_inflight = 0"))
    try:
        # The command reads the same file first: it refuses without asking the server ...
        result = reload_command(appliance, config)
        assert result.returncode == 2
        assert "admission.clients.0.max_inflight" in result.stderr
        # ... and the server, asked anyway (SIGHUP), keeps its table and logs why.
        os.kill(appliance.proc.pid, signal.SIGHUP)
        eventually(lambda: any(e.get("event") == "clients.reload_failed"
                               for e in appliance.log_events()))
        failed = [e for e in appliance.log_events() if e.get("event") == "clients.reload_failed"]
        assert "max_inflight" in str(failed[-1]["error"])
        assert status(appliance, NEW) == 200
    finally:
        config.write_text(good)


def test_sighup_reloads_the_clients_as_systemctl_reload_would(
        rotating: tuple[Appliance, Path]) -> None:
    appliance, config = rotating
    config_with(config, NEWER)
    os.kill(appliance.proc.pid, signal.SIGHUP)
    eventually(lambda: status(appliance, NEWER) == 200)
    assert status(appliance, NEW) == 401
    reloaded = [e for e in appliance.log_events() if e.get("event") == "clients.reloaded"]
    assert reloaded and reloaded[-1]["clients"] == ["app"]
    assert NEWER not in appliance.log_path.read_text()  # keys are never logged


def test_no_http_request_reloads_not_even_from_this_machine(
        rotating: tuple[Appliance, Path]) -> None:
    """A cross-site form POST from a browser here, and a LAN caller through a same-host proxy,
    both arrive from 127.0.0.1: reload is not on HTTP at all, only on the control socket."""
    appliance, config = rotating
    config_with(config, "sk-attacker")
    try:
        for headers in ({"Origin": "http://evil.example",
                         "Content-Type": "application/x-www-form-urlencoded"},
                        {"X-Forwarded-For": "192.168.1.7"}, {}):
            response = httpx.post(f"{appliance.url}/admin/reload", timeout=10, headers=headers,
                                  content=b"x=1")
            assert response.status_code == 404
            assert json.loads(response.text)["error"]["code"] == "not_found"
        assert status(appliance, "sk-attacker") == 401
    finally:
        config_with(config, NEWER)
