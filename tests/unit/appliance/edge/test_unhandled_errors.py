"""An unhandled exception (issue 9 #6): a 500 in the OpenAI shape with the request id, exactly
one log line carrying the traceback, and a metric; injected through a test-only app."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from load.kit.net import free_port
from load.kit.processes import terminate
from tests.metrics_text import samples
from tests.support.stack import ROOT
from tests.unit.appliance.edge.shapes import assert_openai_error

UNHANDLED_METRIC = re.compile(r"appliance_\w*(exception|unhandled|internal|crash)\w*_total$")
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
MARKER = "after-the-fault"  # the request id of the request sent after the faulty one


@dataclass
class Faulty:
    url: str
    log_path: Path

    def log_lines(self) -> list[str]:
        return self.log_path.read_text(errors="replace").splitlines()

    def lines_before_a_later_request(self, since: int, within_s: float = 10.0) -> list[str]:
        """Lines after `since` up to the first line of a request sent now: a handler may log
        just after it answers, and one process writes its log in order, so by the time the
        later request is logged, whatever the earlier one logs (once or twice) is there."""
        httpx.get(f"{self.url}/v1/models", headers={"X-Request-Id": MARKER}, timeout=10)
        deadline = time.monotonic() + within_s
        while True:
            lines = self.log_lines()[since:]
            marked = [i for i, line in enumerate(lines) if MARKER in line]
            if marked:
                return lines[:marked[0]]
            assert time.monotonic() < deadline, "the later request was never logged"
            time.sleep(0.05)

    def unhandled_count(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        return sum(value for (name, _), value in samples(text).items()
                   if UNHANDLED_METRIC.fullmatch(name))


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("faulty") / "app.log"
    upstream = f"http://127.0.0.1:{free_port()}"  # nobody there: the fault comes first
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.unit.appliance.edge.faulty_app", "--port",
                                 str(port), "--upstream", upstream], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        _wait_listening(f"http://127.0.0.1:{port}", proc)
        yield Faulty(f"http://127.0.0.1:{port}", log_path)
    finally:
        terminate(proc)


def _wait_listening(url: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise AssertionError("the faulty app did not start")


def _traceback_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "Traceback (most recent call last)" in line
            or "InjectedFault" in line]


@pytest.mark.parametrize(("method", "path"), [("GET", "/livez"), ("POST", "/v1/chat/completions")])
def test_an_unhandled_exception_is_a_500_in_the_openai_shape_logged_once(
        faulty: Faulty, method: str, path: str) -> None:
    """#6: 500, the OpenAI error shape, the X-Request-Id it was given back, exactly one log
    line with the traceback tagged with that id, and an appliance_*unhandled/exception*
    metric counting it."""
    since, counted = len(faulty.log_lines()), faulty.unhandled_count()
    response = httpx.request(method, f"{faulty.url}{path}", json=CHAT, timeout=10,
                             headers={"X-Request-Id": "fault-probe-1"})
    assert response.status_code == 500
    assert_openai_error(response)
    assert response.headers.get("x-request-id") == "fault-probe-1"
    logged = _traceback_lines(faulty.lines_before_a_later_request(since))
    assert len(logged) == 1, f"{len(logged)} lines carry the traceback, not one"
    assert json.loads(logged[0]).get("request_id") == "fault-probe-1"
    assert faulty.unhandled_count() == counted + 1, "the unhandled exception counted once"
