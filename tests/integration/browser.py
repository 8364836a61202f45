"""Headless Chromium from the system's packages (Debian: chromium, chromium-driver), driven by
selenium. Nothing is downloaded: both binaries are found on PATH or the test fails saying so."""

from __future__ import annotations

import contextlib
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.wait import WebDriverWait

WINDOW = "1280,1700"


def require_browser() -> tuple[str, str]:
    """(chromium, chromedriver) from the system, or an AssertionError that says how to get them."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if browser is None or driver is None:
        raise AssertionError("headless Chromium is needed: apt-get install chromium "
                             "chromium-driver (.ci/run installs them)")
    return browser, driver


@dataclass
class Page:
    """One browser tab on the appliance, with everything its console and network logged."""

    driver: webdriver.Chrome
    console: list[dict[str, Any]] = field(default_factory=list)
    requested_urls: list[str] = field(default_factory=list)

    def open(self, url: str) -> None:
        self.driver.get(url)

    def by_id(self, element_id: str) -> WebElement:
        return self.driver.find_element(By.ID, element_id)

    def text(self, element_id: str) -> str:
        """The element's own text (textContent: CSS such as text-transform does not apply)."""
        return str(self.by_id(element_id).get_attribute("textContent") or "")

    def wait(self, condition: Callable[[Page], object], timeout_s: float, what: str) -> Any:
        return WebDriverWait(self.driver, timeout_s, poll_frequency=0.1).until(
            lambda _: condition(self), message=what)

    def errors(self) -> list[dict[str, Any]]:
        """Console entries at SEVERE (uncaught errors, failed loads) so far."""
        self._drain_logs()
        return [entry for entry in self.console if entry.get("level") == "SEVERE"]

    def urls(self) -> list[str]:
        """Every URL the page asked for so far (from Chromium's own network log)."""
        self._drain_logs()
        return self.requested_urls

    def screenshot(self, path: Path) -> Path:
        self.driver.save_screenshot(str(path))
        return path

    def _drain_logs(self) -> None:
        self.console.extend(self.driver.get_log("browser"))
        for entry in self.driver.get_log("performance"):
            message = json.loads(entry["message"])["message"]
            if message.get("method") == "Network.requestWillBeSent":
                self.requested_urls.append(message["params"]["request"]["url"])


@contextlib.contextmanager
def chromium() -> Iterator[Page]:
    browser, driver_path = require_browser()
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                     "--disable-extensions", "--no-first-run", f"--window-size={WINDOW}"):
        options.add_argument(argument)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL", "performance": "ALL"})
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    try:
        yield Page(driver)
    finally:
        driver.quit()
