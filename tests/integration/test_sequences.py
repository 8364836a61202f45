"""A request's fan-out on the real vLLM worker (issue 35 #8): a batch of prompts holds an
admission slot per sequence, so a neighbour's request is queued behind it as policy.max_inflight
says (it was admitted beside it at once, however wide the batch), and a batch wider than its
client's own limit is refused at once, naming the limit. Prints the neighbour's latency alone
and beside the batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import Appliance, as_client, chat_as, running_with_clients
from tests.metrics_text import value

MAX_INFLIGHT = 8
CLIENTS: list[dict[str, object]] = [
    {"name": "narrow", "key": "sk-narrow", "max_inflight": 4},
    {"name": "wide", "key": "sk-wide"},
    {"name": "neighbour", "key": "sk-neighbour"},
]
BATCH = {"prompt": ["Count to fifty:"] * MAX_INFLIGHT, "max_tokens": 48, "ignore_eos": True}
NEIGHBOUR = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8}


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_with_clients(Path(tmp_path_factory.mktemp("sequences")), CLIENTS,
                              policy__max_inflight=str(MAX_INFLIGHT),
                              admission__queue_wait_s="120") as running:
        yield running


def timed_neighbour(appliance: Appliance) -> tuple[float, int]:
    started = time.perf_counter()
    answer = chat_as(appliance, "neighbour", NEIGHBOUR)
    return time.perf_counter() - started, answer.status_code


def gauge(appliance: Appliance, name: str) -> float:
    return value(httpx.get(f"{appliance.url}/metrics", timeout=10).text, name) or 0.0


def test_a_batch_wider_than_its_clients_limit_is_refused_at_once_naming_it(
        appliance: Appliance) -> None:
    answer = httpx.post(f"{appliance.url}/v1/completions", headers=as_client("narrow"),
                        timeout=30, json={"prompt": ["x"] * 6, "max_tokens": 4})
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "too_many_sequences" and error["param"] == "prompt"
    assert "client 'narrow' max_inflight, 4" in error["message"]


def test_a_batch_holds_a_slot_per_prompt_and_the_neighbour_waits_its_turn(
        appliance: Appliance) -> None:
    timed_neighbour(appliance)  # warm: the first request pays for more
    alone_s, _ = timed_neighbour(appliance)
    ended: list[float] = []

    def batch() -> None:
        answer = httpx.post(f"{appliance.url}/v1/completions", headers=as_client("wide"),
                            timeout=300, json=BATCH)
        assert answer.status_code == 200, answer.text
        ended.append(time.perf_counter())

    sender = threading.Thread(target=batch)
    sender.start()
    deadline = time.monotonic() + 60
    while gauge(appliance, "appliance_requests_in_flight") < MAX_INFLIGHT:
        assert time.monotonic() < deadline and sender.is_alive(), "the batch was never admitted"
        time.sleep(0.05)
    seen_queued: list[float] = []
    done = threading.Event()

    def watch() -> None:  # paced: a scrape in a tight loop takes the engine's cores
        while not done.wait(0.05):
            seen_queued.append(gauge(appliance, "appliance_admission_queued"))

    watcher = threading.Thread(target=watch)
    started = time.perf_counter()
    watcher.start()
    beside_s, status = timed_neighbour(appliance)
    finished = time.perf_counter()
    done.set()
    watcher.join()
    sender.join()
    print(f"\nneighbour: {alone_s:.2f} s alone, {beside_s:.2f} s beside a batch of "
          f"{MAX_INFLIGHT} prompts (policy.max_inflight {MAX_INFLIGHT})")
    assert status == 200
    assert 1 in seen_queued  # it waited for slots: the batch held all of them
    assert ended and started < ended[0] <= finished  # admitted once the batch gave them back
