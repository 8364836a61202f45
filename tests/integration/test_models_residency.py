"""Residency with two real models where only one may be loaded (residency.max_loaded = 1):
requests alternating between SmolLM2 and Gemma 3 270M are all answered, no stream is cut,
swaps are counted; an idle model past its keep_alive_s is unloaded and its worker's memory
given back.

Marked long: Gemma is installed by `install.sh --model gemma3-270m`, which CI does not run."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from load.kit.appliance import Appliance
from load.kit.completions import stream_completion
from load.kit.two_models import gemma_installed, models, one_at_a_time, serving
from tests.metrics_text import value

pytestmark = [pytest.mark.integration, pytest.mark.long]

KEEP_ALIVE_S = 8.0
REQUESTS = 50  # the issue: 50 alternating requests, up to 8 in flight, only one model loaded
IN_FLIGHT = 8


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    if not gemma_installed():
        pytest.skip("Gemma 3 270M is not installed (bash install.sh --model gemma3-270m)")
    tmp_path = tmp_path_factory.mktemp("residency")
    config = one_at_a_time(tmp_path / "residency.toml", min_resident_s=2.0, load_wait_s=240.0,
                           gemma_keep_alive_s=KEEP_ALIVE_S)
    with serving(tmp_path, config) as appliance:
        yield appliance


def stream(appliance: Appliance, model: str) -> tuple[str, float, float, bool]:
    """A streamed completion: (model, seconds to its first token, to its end, ended cleanly)."""
    streamed = stream_completion(appliance.url, {
        "model": model, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
        "ignore_eos": True})
    assert streamed.status == 200, streamed.text
    return model, streamed.first_token_s, streamed.total_s, streamed.clean


def test_at_start_only_one_model_is_loaded(appliance: Appliance) -> None:
    listed = {e["id"]: e["state"] for e in
              httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"]}
    assert listed == {"smollm2": "ready", "gemma": "unloaded"}


def test_alternating_requests_are_all_answered_across_swaps(appliance: Appliance) -> None:
    order = ["gemma" if i % 2 == 0 else "smollm2" for i in range(REQUESTS)]
    with ThreadPoolExecutor(IN_FLIGHT) as pool:
        results = list(pool.map(lambda m: stream(appliance, m), order))
    assert all(clean for *_, clean in results), results  # no stream cut by a swap
    metrics = httpx.get(f"{appliance.url}/metrics", timeout=10).text
    swaps = value(metrics, "appliance_model_swaps_total")
    assert swaps >= 1
    assert value(metrics, "appliance_model_unloads_total", cause="swap") >= 1
    firsts = sorted(first for _, first, _, _ in results)
    print(f"{REQUESTS} alternating streams, {IN_FLIGHT} in flight, max_loaded 1: all answered; "
          f"{swaps:.0f} swaps; first token median {statistics.median(firsts):.1f} s, "
          f"worst {firsts[-1]:.1f} s")


def test_an_idle_model_past_its_keep_alive_is_unloaded_and_its_memory_returned(
        appliance: Appliance) -> None:
    stream(appliance, "gemma")  # loaded now, whatever the last test left
    pid = models(appliance)["gemma"]["pid"]
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    # Unique memory (USS): what the tree alone holds, and an unload gives back; RSS would count
    # the pages its processes share with each other and the template more than once.
    uss = sum(p.memory_full_info().uss for p in tree)
    deadline = time.monotonic() + KEEP_ALIVE_S + 60
    while models(appliance)["gemma"]["state"] != "unloaded":
        assert time.monotonic() < deadline, models(appliance)
        time.sleep(0.5)
    idle = models(appliance)["gemma"]
    assert idle["residency"]["unloads"].get("idle") == 1
    assert not any(p.is_running() for p in tree)  # the whole tree, and its memory, are gone
    print(f"gemma idle past keep_alive_s={KEEP_ALIVE_S:g}: unloaded, its worker tree's "
          f"{uss / 2**20:.0f} MiB (USS) given back")
    # Nothing is pinned here: with no model loaded the box is still ready to load one.
    assert appliance.health().status_code == 200
    _, first, _, clean = stream(appliance, "gemma")
    assert clean
    print(f"gemma loaded again on demand: first token after {first:.1f} s")
