"""The page with API keys configured, in headless Chromium: it asks for the key once, keeps it
in the tab's sessionStorage, sends it only as a header, and it reaches no URL and no log line.

Auth is the appliance's own business, so the synthetic worker stands in for vLLM here."""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import running_synthetic_appliance
from tests.integration.browser import Page, chromium

pytestmark = pytest.mark.synthetic  # no vLLM: the synthetic worker

KEY = "sk-page-test-4f1c9b2e7d"
UPDATE_S = 15


def wait_listening(url: str, timeout_s: float = 60) -> None:
    """/livez answers (it is always open) once the API listens."""
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/livez", timeout=5).status_code == 200:
                return
        assert time.monotonic() < deadline, "the API never listened"
        time.sleep(0.1)


def use_key(page: Page) -> None:
    page.wait(lambda p: p.by_id("key-form").is_displayed(), 60, "the page never asked")
    page.by_id("key-input").send_keys(KEY)
    page.by_id("key-use").click()
    page.wait(lambda p: not p.by_id("key-form").is_displayed(), UPDATE_S, "the form stayed")


@pytest.mark.parametrize("protect_ops_routes", [False, True])
def test_the_page_asks_for_the_key_once_and_keeps_it_in_the_tab_only(
        tmp_path: Path, artefacts: Path, protect_ops_routes: bool) -> None:
    with running_synthetic_appliance(
            tmp_path, "--tokens", "40", "--token-delay", "0.02",
            server__api_keys=json.dumps([KEY]),
            server__protect_ops_routes=str(protect_ops_routes).lower()) as appliance, \
            chromium() as page:
        wait_listening(appliance.url)
        page.open(appliance.url + "/")
        use_key(page)
        page.wait(lambda p: p.text("state") == "ready", 60, "never ready with the key")
        page.wait(lambda p: p.by_id("send").is_enabled(), UPDATE_S, "Send never enabled")
        page.by_id("prompt").send_keys("hello")
        page.by_id("send").click()
        page.wait(lambda p: p.text("play-status").startswith("done"), 30, "no answer")
        page.screenshot(artefacts / f"key-protect-{protect_ops_routes}.png")

        page.open(appliance.url + "/")  # a reload in the same tab does not ask again
        page.wait(lambda p: p.by_id("send").is_enabled(), UPDATE_S, "not usable after reload")
        assert not page.by_id("key-form").is_displayed()
        storage = page.driver.execute_script(
            "return [sessionStorage.getItem('chat-appliance.api-key'), localStorage.length]")
        assert storage == [KEY, 0]
        assert page.urls() and not [url for url in page.urls() if KEY in url]
        assert KEY not in appliance.log_path.read_text()
        unexpected = [e for e in page.errors() if "401" not in e["message"]]
        assert unexpected == [], "only the first, keyless calls may fail (401)"
