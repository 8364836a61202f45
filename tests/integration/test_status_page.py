"""The status page and playground in headless Chromium, against the real vLLM worker: loads
clean and shows ready, streams an answer, Stop aborts it on the engine, and a killed worker
shows as an outage, then as a recovery. Screenshots land in the folder printed at the end."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import ENGINE_BOOT_S, Appliance
from supervisor.engine.stats import parse_engine_stats
from tests.integration.browser import Page, chromium
from tests.metrics_text import samples

UPDATE_S = 15  # the page polls every status.refresh_s (2 s); slack for a loaded machine
CLOCK_SLACK_S = 0.01  # the log's timestamps are rounded to the millisecond


@pytest.fixture(scope="module")
def page(appliance: Appliance) -> Iterator[Page]:
    with chromium() as tab:
        tab.open(appliance.url + "/")
        yield tab


def engine_running(appliance: Appliance) -> float:
    """The worker's own vllm:num_requests_running."""
    text = appliance.engine_get("/metrics", timeout_s=10).text
    return parse_engine_stats(text).running


def disconnect_aborts(appliance: Appliance) -> float:
    text = httpx.get(f"{appliance.url}/metrics", timeout=10).text
    return samples(text).get(("appliance_client_disconnects_total",
                              frozenset({("stream", "true")})), 0.0)


def snapshot(appliance: Appliance, page: Page, artefacts: Path, name: str) -> None:
    """What a person saw (a screenshot) and what a script would read (/status.json)."""
    page.screenshot(artefacts / f"{name}.png")
    doc = httpx.get(f"{appliance.url}/status.json", timeout=10).json()
    (artefacts / f"{name}.json").write_text(json.dumps(doc, indent=1))


def logged_at(appliance: Appliance, event: str, request_id: str) -> float | None:
    """Wall-clock time of the appliance's log event for that request, if written yet."""
    for line in appliance.log_events():
        if line.get("event") == event and line.get("request_id") == request_id:
            return datetime.fromisoformat(str(line["timestamp"])).timestamp()
    return None


def ask(page: Page, prompt: str, max_tokens: int) -> None:
    page.wait(lambda p: p.by_id("send").is_enabled(), UPDATE_S, "Send never enabled")
    field = page.by_id("play-max-tokens")
    field.clear()
    field.send_keys(str(max_tokens))
    page.by_id("prompt").send_keys(prompt)
    page.by_id("send").click()


def answer(page: Page) -> str:
    """The text of the last assistant turn, without its label."""
    turns = page.driver.find_elements("css selector", "#transcript .turn.assistant")
    return str(turns[-1].get_attribute("textContent") or "").removeprefix("assistant") if turns else ""


def test_the_page_loads_without_console_errors_and_shows_ready(
        appliance: Appliance, page: Page, artefacts: Path) -> None:
    page.wait(lambda p: p.text("state") == "ready", UPDATE_S, "the page never said ready")
    assert page.by_id("banner").get_attribute("hidden") is not None
    model = appliance.health().json()["model"]
    assert page.text("model") == model
    page.wait(lambda p: p.by_id("play-model").get_attribute("value") == model, UPDATE_S,
              "the playground never listed the model")
    # The appliance is shared: the modules before may have restarted its worker.
    assert page.text("engine-restarts") == str(appliance.health().json()["restarts"])
    assert appliance.health().json()["gpu"]["status"] in page.text("gpu")
    assert page.errors() == []
    snapshot(appliance, page, artefacts, "1-healthy")


def test_a_prompt_streams_its_answer_into_the_page_token_by_token(
        appliance: Appliance, page: Page, artefacts: Path) -> None:
    ask(page, "What is the capital of France?", 48)
    lengths: set[int] = set()

    def finished(p: Page) -> bool:
        lengths.add(len(answer(p)))
        return p.text("play-status").startswith("done")

    page.wait(finished, 120, "the answer never finished")
    assert len(lengths - {0}) >= 3, f"the answer appeared at once, not streamed: {lengths}"
    assert answer(page).strip()
    request_id = page.text("request-id")
    assert re.fullmatch(r"[0-9a-f]{32}", request_id), request_id
    logged = appliance.wait_for_event(lambda e: e.get("request_id") == request_id)
    assert logged, "the id shown is the one the appliance's log lines carry"
    snapshot(appliance, page, artefacts, "2-answered")
    assert page.errors() == []


def test_stop_aborts_the_request_on_the_engine(appliance: Appliance, page: Page,
                                               artefacts: Path) -> None:
    page.by_id("play-new").click()
    aborts_before = disconnect_aborts(appliance)
    ask(page, "Count from 1 to 1000, one number per line.", 1500)
    page.wait(lambda p: len(answer(p)) > 20, 120, "the answer never started")
    before = appliance.engine_stats()
    assert before.running == 1
    clicked_at = time.time()
    page.by_id("stop").click()
    generated = appliance.generated_until_idle(dataclasses.replace(before, running=0))
    page.wait(lambda p: p.text("play-status").startswith("stopped"), UPDATE_S,
              "the page never said stopped")
    assert disconnect_aborts(appliance) == aborts_before + 1
    # In order: Stop is clicked, the appliance sees the browser leave, the engine stops the
    # request short of its budget (how soon is load.bench.reactions's to measure).
    seen_at = logged_at(appliance, "request.client_disconnected", page.text("request-id"))
    assert seen_at is not None and seen_at >= clicked_at - CLOCK_SLACK_S, (seen_at, clicked_at)
    assert generated < 1500, f"the engine finished all {generated:.0f} tokens after Stop"
    page.wait(lambda p: p.text("disconnects").startswith(f"{int(aborts_before) + 1} streaming"),
              UPDATE_S, "the page never counted the abort")
    print(f"Stop → appliance saw the disconnect after {seen_at - clicked_at:.2f}s")
    snapshot(appliance, page, artefacts, "3-stopped")
    assert page.errors() == []


def test_a_killed_worker_shows_as_an_outage_then_as_a_recovery(
        appliance: Appliance, page: Page, artefacts: Path) -> None:
    restarts = int(appliance.wait_ready()["restarts"])  # a serving worker is the one killed
    os.kill(appliance.worker_pid(), signal.SIGKILL)
    page.wait(lambda p: p.text("state") != "ready", UPDATE_S, "the page never showed the outage")
    page.wait(lambda p: "SIGKILL" in p.text("exits"), UPDATE_S, "the exit's cause never showed")
    assert page.by_id("banner").get_attribute("hidden") is None
    assert "restarting" in page.text("exits")
    assert not page.by_id("send").is_enabled()
    snapshot(appliance, page, artefacts, "4-outage")

    page.wait(lambda p: p.text("state") == "ready", ENGINE_BOOT_S, "the page never recovered")
    page.wait(lambda p: re.search(r"= [0-9.]+ s", p.text("exits")), UPDATE_S,
              "the restart's timings never showed")
    assert page.text("engine-restarts") == str(restarts + 1)
    page.wait(lambda p: p.by_id("send").is_enabled(), UPDATE_S, "Send never came back")
    snapshot(appliance, page, artefacts, "5-recovered")
    assert page.errors() == [], "the outage made the page log errors"
