"""The run-time cost abort on the real vLLM worker (issue 20 #1): a constrained request that
passes the gate's static vetting but makes every token of the engine slow is aborted once
another request shares the engine, so that request stays within 3x of its time alone; the
costly one ends with `request_too_costly`, logged and counted. Side by side with the abort off:
`python -m load.hostile.cost_abort`."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from load.hostile.constraint_cost import VICTIM
from load.hostile.cost_abort import COSTLY, victim_beside_costly
from load.kit.appliance import Appliance
from tests.metrics_text import value

pytestmark = pytest.mark.long  # timed side-by-side runs, about 100 s: `pytest -m long`

BAR = 3.0


@pytest.fixture(scope="module")
def worker(appliance: Appliance) -> Appliance:
    return appliance


def aborted(appliance: Appliance) -> list[dict[str, object]]:
    return [e for e in appliance.log_events() if e.get("event") == "request.too_costly"]


def test_a_short_request_stays_within_3x_while_a_costly_constrained_stream_runs(
        worker: Appliance) -> None:
    before = len(aborted(worker))
    outcome = victim_beside_costly(worker.url)
    assert outcome.beside_status == 200
    assert outcome.costly.error_code == "request_too_costly", outcome.costly.gaps
    assert outcome.ratio <= BAR, (f"victim {outcome.beside_s:.2f} s beside the costly request, "
                                  f"{outcome.alone_s:.2f} s alone")
    logged = aborted(worker)[before:]
    assert logged and logged[0]["param"] == "structured_outputs.grammar"
    metrics = httpx.get(f"{worker.url}/metrics", timeout=10).text
    assert (value(metrics, "appliance_requests_too_costly_total") or 0) >= 1


def test_a_costly_request_not_streamed_is_caught_through_a_streamed_peer(
        worker: Appliance) -> None:
    """Its own progress is not seen; a stream beside it shows the engine's slow steps."""
    answers: list[httpx.Response] = []
    costly = COSTLY | {"stream": False}
    sender = threading.Thread(target=lambda: answers.append(
        httpx.post(f"{worker.url}/v1/chat/completions", json=costly, timeout=600)))
    sender.start()
    time.sleep(5)  # not a timing assert: the costly request grows slower as it runs
    with httpx.stream("POST", f"{worker.url}/v1/chat/completions", timeout=600,
                      json=VICTIM | {"stream": True, "max_tokens": 60}) as peer:
        peer.read()
    sender.join()
    assert answers[0].status_code == 400, answers[0].text
    assert answers[0].json()["error"]["code"] == "request_too_costly"


def test_a_stream_of_many_tokens_an_event_gets_no_constrained_request_aborted(
        worker: Appliance) -> None:
    """Issue 35 #6: a client streaming with stream_interval 12 (an event each 12 steps) beside
    another client's regex-constrained request, running at the engine's pace: the watch counts
    the event's tokens, and nobody is aborted."""
    before = len(aborted(worker))
    # Longer than the constrained request's 120 tokens after its own first 24, so that it
    # runs beside it throughout.
    body = {"messages": [{"role": "user", "content": "Count to a hundred."}], "max_tokens": 200,
            "ignore_eos": True, "stream": True, "stream_interval": 12}
    constrained = {"messages": [{"role": "user", "content": "Write a sentence."}],
                   "max_tokens": 120, "ignore_eos": True,
                   "structured_outputs": {"regex": "[a-z ]+"}}
    with httpx.Client(base_url=worker.url, timeout=600) as client, \
            client.stream("POST", "/v1/chat/completions", json=body) as interval:
        lines = interval.iter_lines()
        events = 0
        while events < 2:  # its tokens come many at once now
            events += next(lines).startswith("data: {")
        started = time.perf_counter()
        answer = client.post("/v1/chat/completions", json=constrained)
        took_s = time.perf_counter() - started
        tail = [line for line in lines if line.startswith("data: {")]
    print(f"\nconstrained request beside a stream_interval 12 stream: {took_s:.2f} s")
    assert answer.status_code == 200, answer.text
    assert aborted(worker)[before:] == []
    assert tail and '"error"' not in tail[-1]
