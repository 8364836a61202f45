"""`chat-appliance drain` on the real appliance (real supervisor, real vLLM CPU worker): the box
says not-ready within a second, a stream it holds ends whole, a new request is told 503 with
Retry-After before any byte (so a router sends it elsewhere), and the supervisor exits 0
leaving no process of the worker or the template behind."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from load.kit.appliance import long_stream, running_appliance
from load.kit.isolation import clean_env
from supervisor.engine.worker import session_members

READY_WITHIN_S = 1.0  # the bound: a router must stop sending at once
DRAIN_BOUND_S = 120  # supervisor.drain_timeout_s here: the stream below finishes well inside it


def test_drain_stops_taking_work_finishes_the_stream_and_exits_0(tmp_path: Path) -> None:
    socket_dir = Path(tempfile.mkdtemp(prefix="ca-drain-"))  # a socket path fits 107 bytes
    control = socket_dir / "control.sock"
    with running_appliance(tmp_path, server__control_socket=str(control),
                           supervisor__drain_timeout_s=str(DRAIN_BOUND_S)) as appliance:
        pid = int(appliance.wait_ready()["pid"])
        template = appliance.template_pid()
        assert session_members(pid) and session_members(template)
        assert {pid, template} <= {p.pid for p in appliance.tree()}
        assert httpx.get(f"{appliance.url}/readyz", timeout=5).status_code == 200
        reader, lines = long_stream(appliance, [{"role": "user", "content": "Count to a thousand."}],
                                    timeout_s=DRAIN_BOUND_S, max_tokens=150)

        command = subprocess.run([sys.executable, "-m", "supervisor.main", "drain",
                                  "--socket", str(control)], env=clean_env(),
                                 capture_output=True, text=True, timeout=30, check=False)
        asked = time.monotonic()
        assert command.returncode == 0, command.stderr
        assert command.stdout.splitlines()[-1].startswith("draining: 1 in flight")

        # Not ready within a second of the command.
        while True:
            ready = httpx.get(f"{appliance.url}/readyz", timeout=5)
            if ready.status_code == 503:
                break
            assert time.monotonic() - asked < READY_WITHIN_S, "still ready after the drain"
        took = time.monotonic() - asked
        assert took < READY_WITHIN_S and ready.json()["state"] == "draining"
        assert int(ready.headers["retry-after"]) >= 1
        assert httpx.get(f"{appliance.url}/livez", timeout=5).status_code == 200  # still alive

        # A new request: 503 + Retry-After, the OpenAI error shape, before any byte of an answer.
        assert reader.is_alive(), "the stream ended before the new request was asked"
        for stream in (False, True):
            refused = httpx.post(f"{appliance.url}/v1/chat/completions", timeout=30, json={
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                "stream": stream})
            assert refused.status_code == 503, refused.text
            assert int(refused.headers["retry-after"]) >= 1
            assert refused.headers["content-type"].startswith("application/json")
            assert set(refused.json()["error"]) == {"message", "type", "param", "code"}

        # The stream held at the drain ends whole: every token asked for, then [DONE].
        reader.join(DRAIN_BOUND_S)
        assert not reader.is_alive()
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        assert not any("error" in chunk for chunk in chunks)
        finish = [c["choices"][0]["finish_reason"] for c in chunks if c.get("choices")]
        assert finish[-1] == "length"

        assert appliance.proc.wait(DRAIN_BOUND_S) == 0
        assert not session_members(pid) and not session_members(template)
        assert not appliance.tree(), "nothing the appliance started outlives it"
        events = [e.get("event") for e in appliance.log_events()]
        assert "supervisor.drain_requested" in events and "supervisor.stopped" in events
        assert "worker.output" in events, "the worker's output is re-emitted with source=worker"
        drained = [e for e in appliance.log_events() if e.get("event") == "supervisor.drained"]
        assert drained and drained[0]["left"] == 0 and drained[0]["forced"] is False
        print(f"readyz 503 {took * 1000:.0f} ms after the drain command")
