"""A legitimate long prefill is not a hung engine (issue 9 #1), against the real vLLM CPU worker.

One boot, with the watchdog set short (no counter movement for 2 s is a stall; a canary of 3 s)
so that the longest prompt the window allows meets it: on two CPU cores its prefill moves none
of the engine's counters for longer than that, which the test checks from the engine's own
counters, so that it cannot pass with a prefill too short to matter.
(That a SIGSTOPped EngineCore is still declared hung is test_watchdog.py's.)
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import Appliance, running_appliance
from load.kit.procstat import Sampler
from tests.support.stack import settings_env

WINDOW = 2048  # the harness's engine.max_model_len
HANG_STALL_S = 2.0
SHORT_WATCHDOG = {"supervisor.hang_stall_s": HANG_STALL_S,
                  "supervisor.progress_interval_s": 0.5,
                  "supervisor.canary_timeout_s": 3}


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    with running_appliance(Path(tmp_path_factory.mktemp("prefill")),
                           env_extra=settings_env(SHORT_WATCHDOG)) as appliance:
        appliance.wait_ready()
        yield appliance


class StallMeter(Sampler):
    """Samples the worker's counters while a request runs: the longest stretch none of them
    moved (what the progress watch sees of a prefill; vLLM's running gauge is not updated
    during one either, so the request being in flight is what says the engine is busy)."""

    def __init__(self, appliance: Appliance) -> None:
        super().__init__(interval_s=0.1, join_s=30)
        self.longest_s = 0.0
        self._appliance = appliance
        self._since = time.monotonic()
        self._last: tuple[float, ...] | None = None

    def sample(self) -> None:
        progress = self._appliance.engine_stats().progress
        now = time.monotonic()
        if progress != self._last:
            self._since, self._last = now, progress
        else:
            self.longest_s = max(self.longest_s, now - self._since)


def _prompt_of(appliance: Appliance, tokens: int) -> str:
    """Text that the worker's own tokenizer counts as exactly `tokens` tokens."""
    model = httpx.get(f"{appliance.url}/v1/models", timeout=10).json()["data"][0]["id"]
    ids = appliance.engine_call("POST", "/tokenize", timeout_s=60, json={
        "model": model, "prompt": "hello world " * tokens, "add_special_tokens": False,
    }).json()["tokens"][:tokens]
    text = str(appliance.engine_call("POST", "/detokenize", timeout_s=60,
                                     json={"model": model, "tokens": ids}).json()["prompt"])
    count = appliance.engine_call("POST", "/tokenize", timeout_s=60,
                                  json={"model": model, "prompt": text}).json()["count"]
    assert abs(count - tokens) <= 2, count
    return text


def test_the_longest_prompt_the_window_allows_is_answered_by_the_same_worker(
        watched: Appliance) -> None:
    """#1: a completions prompt of window - 16 tokens (the worker's tokenizer) with the stall
    and canary timeouts at 2 s and 3 s: 200, the worker pid and the restart count unchanged,
    though the engine's counters stood still for longer than the stall timeout meanwhile.
    (Test written on 64a2e0c, where it failed: 503 engine_lost, the worker restarted.)"""
    watched.wait_ready()
    before = watched.health().json()
    prompt = _prompt_of(watched, WINDOW - 16)
    with StallMeter(watched) as meter:
        response = httpx.post(f"{watched.url}/v1/completions", timeout=600,
                              json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    after = watched.health().json()
    assert response.status_code == 200, response.text[:300]
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"]), after
    assert meter.longest_s > HANG_STALL_S, (
        f"the prefill moved the counters within {meter.longest_s:.1f} s: it never met the "
        f"{HANG_STALL_S} s stall timeout, so this run proves nothing")
