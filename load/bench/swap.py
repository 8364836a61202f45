"""What a model swap costs on the real CPU worker, beside a cold start, in one run.

    python -m load.bench.swap [--swaps 4]

One appliance serving the bundled SmolLM2 and Gemma 3 270M (`install.sh --model gemma3-270m`)
with `residency.max_loaded = 1`. First the cold start: `serve` to the default model's first
answer. Then `--swaps` requests that each name the model not loaded, one after the other: per
request the swap (the other model drained and stopped, this one started from its template) as
the appliance logs it, and the request's first token, which waited for it. Then, as reference,
a request to the model already loaded. One JSON object per line, then a summary line with the
median and worst of each.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from load.kit.appliance import Appliance, running_appliance
from load.kit.completions import stream_completion
from load.kit.two_models import gemma_installed, one_at_a_time


def emit(**fields: Any) -> None:
    print(json.dumps({**fields, "load": round(os.getloadavg()[0], 1)}), flush=True)


def first_token(appliance: Appliance, model: str) -> float:
    streamed = stream_completion(appliance.url, {
        "model": model, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 0,
        "ignore_eos": True})
    assert streamed.status == 200 and streamed.clean, streamed.text
    return streamed.first_token_s


def swap_seconds(appliance: Appliance, model: str, since: int) -> float | None:
    """From the appliance's log: the swap that loaded `model` after log event `since`, from the
    other model's unloading to this one's ready."""
    events = appliance.log_events()[since:]
    start = next((e for e in events if e.get("event") == "model.unloading"), None)
    ready = next((e for e in events if e.get("event") == "engine.state"
                  and e.get("new") == "ready" and start is not None
                  and str(e["timestamp"]) > str(start["timestamp"])), None)
    if start is None or ready is None:
        return None
    return _seconds(str(ready["timestamp"])) - _seconds(str(start["timestamp"]))


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def run(swaps: int, work: Path) -> None:
    if not gemma_installed():
        raise SystemExit("Gemma 3 270M is not installed: bash install.sh --model gemma3-270m")
    config = one_at_a_time(work / "swap.toml", min_resident_s=0.0, load_wait_s=300.0)
    started = time.monotonic()
    with running_appliance(work, {"CHAT_APPLIANCE_CONFIG": str(config)}) as appliance:
        appliance.wait_ready()
        cold = time.monotonic() - started + first_token(appliance, "smollm2")
        emit(event="cold_start", model="smollm2", first_token_after_start_s=round(cold, 2))
        swapped, firsts, loaded = [], [], "smollm2"
        for index in range(swaps):
            model = "gemma" if loaded == "smollm2" else "smollm2"
            since = len(appliance.log_events())
            first = first_token(appliance, model)
            swap = swap_seconds(appliance, model, since)
            emit(event="swap", index=index, model=model, swap_s=swap and round(swap, 2),
                 first_token_s=round(first, 2))
            firsts.append(first)
            if swap is not None:
                swapped.append(swap)
            loaded = model
        warm = first_token(appliance, loaded)
        emit(event="loaded", model=loaded, first_token_s=round(warm, 2))
    emit(event="summary", cold_start_s=round(cold, 2),
         swap_median_s=swapped and round(statistics.median(swapped), 2),
         swap_worst_s=swapped and round(max(swapped), 2),
         first_token_after_swap_median_s=round(statistics.median(firsts), 2),
         first_token_after_swap_worst_s=round(max(firsts), 2),
         first_token_loaded_s=round(warm, 2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--swaps", type=int, default=4)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-swap-") as work:
        run(args.swaps, Path(work))


if __name__ == "__main__":
    main()
