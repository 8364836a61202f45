"""A legitimate long prefill is not a hung engine (issue 9 #1), against the real vLLM CPU worker.

One boot, with the watchdog set short (a stall of 5 s, a canary of 3 s, under whichever of the
names below this tree's settings have) so that the longest prompt the window allows meets it:
on two CPU cores its prefill sends no byte for far longer than that.
(That a SIGSTOPped EngineCore is still declared hung is test_watchdog.py's.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.harness import Appliance, running_appliance
from tests.support.stack import known_settings

WINDOW = 2048  # the harness's engine.max_model_len
SHORT_WATCHDOG = {"supervisor.stall_timeout_s": 5, "supervisor.hang_stall_s": 5,
                  "supervisor.canary_timeout_s": 3}


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    watchdog = {"CHAT_APPLIANCE_" + key.upper().replace(".", "__"): str(value)
                for key, value in known_settings(SHORT_WATCHDOG).items()}
    assert watchdog, "no watchdog setting of this tree is known to the test"
    with running_appliance(Path(tmp_path_factory.mktemp("prefill")),
                           env_extra=watchdog) as appliance:
        appliance.wait_ready()
        yield appliance


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
    and canary timeouts at 5 s and 3 s: 200, the worker pid and the restart count unchanged.
    (Test written on 64a2e0c, where it failed: 503 engine_lost, the worker restarted.)"""
    watched.wait_ready()
    before = watched.health().json()
    prompt = _prompt_of(watched, WINDOW - 16)
    response = httpx.post(f"{watched.url}/v1/completions", timeout=600,
                          json={"prompt": prompt, "max_tokens": 8, "temperature": 0})
    after = watched.health().json()
    assert response.status_code == 200, response.text[:300]
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"]), after
