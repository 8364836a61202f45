"""One input that kills the engine does not keep the box in a crash loop: after two engine deaths
with it in flight it is refused (request_quarantined), while another client is served; and
requests that ran to their end on an engine that lived are never refused for it.

Over the synthetic worker started with --die-on (it SIGKILLs itself on the marker, as an engine
crashes on a poison input): the real supervisor sees each death, its forensics tell the
quarantine what was in flight, and the relay sends the marker again itself (resume) after the
first death, and refuses it after the second. Both clients retry on 503 as the SDKs do
(Retry-After, a bounded number of times).

The innocent side runs on the real vLLM CPU worker: the same eight greedy chat requests are in
flight at a kill -9 of the worker and, once they were answered, at a freeze (SIGSTOP) of
EngineCore; each is answered both times."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from load.kit.appliance import Appliance, running_synthetic_appliance
from tests.metrics_text import value

MARKER = "synthetic:die"
ATTEMPTS = 12  # the marker's client: enough to trip the crash-loop guard without the quarantine


def ask(appliance: Appliance, prompt: str, attempts: int = ATTEMPTS,
        wait_cap_s: float = 1.0) -> tuple[httpx.Response, int]:
    """A chat completion retried on 503 as an SDK retries it: the same body each time."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4}
    for attempt in range(1, attempts + 1):
        response = httpx.post(f"{appliance.url}/v1/chat/completions", json=body, timeout=30)
        if response.status_code != 503 or attempt == attempts:
            return response, attempt
        time.sleep(min(float(response.headers.get("retry-after", "1")), wait_cap_s))
    raise AssertionError("unreachable")


def quarantined_id(events: list[dict[str, object]]) -> object:
    return next(e.get("request_id") for e in events if e.get("event") == "request.quarantined")


@pytest.mark.synthetic  # no vLLM: the synthetic worker dies on its marker
def test_an_input_that_kills_the_engine_is_quarantined_after_two_deaths_others_served(
        tmp_path: Path) -> None:
    with running_synthetic_appliance(tmp_path, "--die-on", MARKER, "--tokens", "4",
                                     supervisor__crash_loop_restarts="3",
                                     server__retry_after_s="1") as appliance:
        appliance.wait_ready(60)
        served: list[int] = []
        done = threading.Event()

        def other_client() -> None:
            number = 0
            while not done.is_set() or number < 3:
                response, _ = ask(appliance, f"question {number}", attempts=60, wait_cap_s=0.3)
                served.append(response.status_code)
                number += 1
                time.sleep(0.2)

        other = threading.Thread(target=other_client)
        other.start()
        try:
            marker, attempts = ask(appliance, f"please {MARKER} now")
        finally:
            done.set()
            other.join(120)
        after, _ = ask(appliance, "and after it", attempts=1)
        status = httpx.get(f"{appliance.url}/status.json", timeout=10).json()
        metrics = httpx.get(f"{appliance.url}/metrics", timeout=10).text
        events = appliance.log_events()

    assert marker.status_code == 422, (marker.status_code, marker.text)
    error = marker.json()["error"]  # the OpenAI shape, as the route speaks it
    assert error["code"] == "request_quarantined" and error["type"] == "invalid_request_error"
    # The appliance sent it to the restarted engine itself once (resume): the engine died
    # twice with it in flight (the bundles below) before its client saw anything at all.
    assert attempts == 1
    replayed = [e for e in events if e.get("event") == "request.outlived_engine_fault"
                and e.get("request_id") == quarantined_id(events)]
    assert len(replayed) == 1
    names = Counter(str(e.get("event")) for e in events)
    assert names["worker.spawned"] <= 3, names  # the first worker and at most two restarts
    failed = [e for e in events if e.get("event") == "engine.state" and e.get("new") == "failed"]
    assert failed == [], "the crash-loop guard was reached"
    assert served and set(served) == {200}, served  # the other client got every answer
    assert after.status_code == 200
    [quarantined] = [e for e in events if e.get("event") == "request.quarantined"]
    bundles = [json.loads(p.read_text()) for p in sorted((tmp_path / "crashes").glob("*.json"))]
    assert len(bundles) == 2
    for bundle in bundles:  # the log names the fingerprint the crash bundles recorded
        assert quarantined["fingerprint"] in {r["fingerprint"] for r in bundle["in_flight"]}
    held = status["requests"]["quarantined"]
    assert held["count"] == 1 and held["newest"][0]["fingerprint"] == quarantined["fingerprint"]
    assert value(metrics, "appliance_requests_quarantined_total") == 1


INNOCENT = [{"messages": [{"role": "user", "content": f"Count from {n} to {n + 30}, in words."}],
             "max_tokens": 48, "ignore_eos": True, "temperature": 0} for n in range(8)]


def engine_core(appliance: Appliance) -> psutil.Process:
    children = psutil.Process(appliance.worker_pid()).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name())


def answered_through(appliance: Appliance, fault: Callable[[], None]) -> list[httpx.Response]:
    """The eight requests at once, the fault once the engine has all of them, every answer."""
    old = appliance.worker_pid()
    answers: dict[int, httpx.Response] = {}

    def send(index: int, body: dict[str, Any]) -> None:
        answers[index] = httpx.post(f"{appliance.url}/v1/chat/completions", json=body,
                                    timeout=600)

    senders = [threading.Thread(target=send, args=item) for item in enumerate(INNOCENT)]
    for sender in senders:
        sender.start()
    deadline = time.monotonic() + 120
    while (stats := appliance.engine_stats()).running + stats.waiting < len(INNOCENT):
        assert not answers, "answered before the fault"
        assert time.monotonic() < deadline, "the engine never had all eight"
        time.sleep(0.02)
    fault()
    for sender in senders:
        sender.join(600)
    assert appliance.wait_ready()["pid"] != old
    return [answers[index] for index in range(len(INNOCENT))]


@pytest.mark.long  # eight long answers through a kill and a freeze, about a minute
def test_requests_answered_through_a_kill_are_answered_through_an_unrelated_freeze(
        appliance: Appliance) -> None:
    crashes = appliance.log_path.parent / "crashes"  # running_appliance's crashes.dir
    earlier = set(crashes.glob("*.json"))
    logged_before = len(appliance.log_events())
    killed = answered_through(appliance, lambda: os.kill(appliance.worker_pid(), signal.SIGKILL))
    frozen = answered_through(appliance,
                              lambda: engine_core(appliance).send_signal(signal.SIGSTOP))
    status = httpx.get(f"{appliance.url}/status.json", timeout=10).json()
    events = appliance.log_events()[logged_before:]

    for answers in (killed, frozen):
        assert [a.status_code for a in answers] == [200] * len(INNOCENT), [a.text for a in answers]
        assert all(a.json()["choices"][0]["message"]["content"] for a in answers)
    assert [e for e in events if e.get("event") == "request.quarantined"] == []
    assert status["requests"]["quarantined"]["count"] == 0
    # Both faults were deaths with all eight in flight, each fingerprint told each time...
    bundles = [json.loads(p.read_text()) for p in sorted(set(crashes.glob("*.json")) - earlier)]
    assert [b["cause"]["reason"] for b in bundles] in (["exited", "hung"], ["exited", "unhealthy"])
    fingerprints = [{r["fingerprint"] for r in b["in_flight"]} for b in bundles]
    assert len(fingerprints[0]) == len(INNOCENT) and fingerprints[0] == fingerprints[1]
    # ...and cleared by the answer each had from the next worker.
    cleared = Counter(str(e["fingerprint"]) for e in events
                      if e.get("event") == "request.quarantine_cleared")
    assert cleared == Counter({fingerprint: 2 for fingerprint in fingerprints[0]})
