"""The reservation planner with two real models whose reservations do not fit together
(residency.memory_bytes just under their sum, no max_loaded): only SmolLM2 is loaded at start,
and a request for Gemma swaps it out.

Marked long: Gemma is installed by `install.sh --model gemma3-270m`, which CI does not run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from load.kit.appliance import Appliance
from load.kit.completions import stream_completion
from load.kit.two_models import GEMMA, SMOLLM2, gemma_installed, models, one_at_a_time, serving
from tests.metrics_text import value

pytestmark = [pytest.mark.integration, pytest.mark.long]

KV_CACHE_BYTES = 512 * 1024**2  # [engine]'s default on the CPU; the catalog sets none


def reservation(model_dir: Path) -> int:
    """The planner's CPU reservation, from the files: KV cache plus weights on disk."""
    return KV_CACHE_BYTES + sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))


@pytest.fixture(scope="module")
def appliance(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Appliance]:
    if not gemma_installed():
        pytest.skip("Gemma 3 270M is not installed (bash install.sh --model gemma3-270m)")
    tmp_path = tmp_path_factory.mktemp("plan")
    capacity = reservation(SMOLLM2) + reservation(GEMMA) - 1
    config = one_at_a_time(tmp_path / "plan.toml", min_resident_s=0.0, load_wait_s=240.0,
                           memory_bytes=capacity)
    with serving(tmp_path, config) as appliance:
        yield appliance


def test_a_request_for_the_second_model_swaps_the_first_out(appliance: Appliance) -> None:
    listed = {e["id"]: e["state"] for e in
              httpx.get(f"{appliance.url}/v1/models", timeout=30).json()["data"]}
    assert listed == {"smollm2": "ready", "gemma": "unloaded"}  # the two do not fit together
    streamed = stream_completion(appliance.url, {
        "model": "gemma", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
    assert streamed.status == 200 and streamed.clean, streamed.text
    after = models(appliance)
    assert after["smollm2"]["state"] == "unloaded" and after["gemma"]["state"] == "ready"
    assert after["gemma"]["residency"]["reserved_bytes"] == reservation(GEMMA)
    metrics = httpx.get(f"{appliance.url}/metrics", timeout=10).text
    assert value(metrics, "appliance_model_swaps_total", model="gemma") == 1
    assert value(metrics, "appliance_model_unloads_total", model="smollm2", cause="swap") == 1
    print(f"gemma asked with capacity {value(metrics, 'appliance_residency_capacity_bytes'):.0f}"
          f" B: smollm2 swapped out, gemma's first token after {streamed.first_token_s:.1f} s")
