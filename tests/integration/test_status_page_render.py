"""What the page draws for states the CPU test box cannot produce: a GPU's gauges (no GPU here),
an engine held in `failed` and a quarantined request. The app is served in-process over a fake
engine view; the page is the real one, in headless Chromium."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from appliance.app import create_app
from appliance.core.engine import EngineState
from appliance.core.sections import ResumeSettings
from appliance.core.settings import Settings
from appliance.recovery.quarantine import Quarantine
from load.kit.net import free_port
from tests.integration.browser import chromium
from tests.unit.appliance.fakes import FakeEngine

pytestmark = pytest.mark.synthetic  # no vLLM: a fake engine view, in-process

GIB = 1024**3
GPU = {"status": "unhealthy", "name": "NVIDIA H200", "uuid": "GPU-0", "memory_used_bytes": 80 * GIB,
       "memory_total_bytes": 141 * GIB, "utilization_pct": 93, "temperature_c": 87,
       "slowdown_reasons": ["sw_thermal"], "warnings": ["thermal slowdown"], "last_xid": 79,
       "health": {"action": "fail", "cause": "Xid 79: GPU has fallen off the bus"}}
CANARY = {"verdict": "mismatch", "ok": False, "key": "big-model|auto|cuda|vllm 0.32.0",
          "detail": "1 of 3 greedy answers differ from the record: prompt 2 gave [5], "
                    "recorded [6]", "worker": 4242, "at": 1.7e9, "differing": [2]}
EXIT = {"phase": "running", "reason": "gpu_fatal", "detail": "GPU is lost", "at": 1.7e9,
        "restart": {}}


class GpuEngine(FakeEngine):
    def snapshot(self) -> dict[str, Any]:
        return super().snapshot() | {"gpu": GPU, "last_exit": EXIT, "recent_exits": [EXIT],
                                     "model": "big-model", "supervisor_uptime_s": 3725.0,
                                     "canary": CANARY}


@pytest.fixture
def served() -> Iterator[str]:
    port = free_port()
    engine = GpuEngine("http://127.0.0.1:9", state=EngineState.FAILED)
    quarantine = Quarantine(ResumeSettings())
    for _ in range(2):  # one input in flight at two engine deaths
        quarantine.died(["0123456789abcdef"])
    app = create_app(Settings(), engine, quarantine=quarantine)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           lifespan="on"))
    thread = threading.Thread(target=server.run)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive(), "the app did not start"
            threading.Event().wait(0.02)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_a_gpu_and_a_failed_engine_are_drawn_from_status_json(served: str,
                                                             artefacts: Path) -> None:
    with chromium() as page:
        page.open(served + "/")
        page.wait(lambda p: p.text("state") == "failed", 15, "the page never said failed")
        assert "state-failed" in (page.by_id("state").get_attribute("class") or "")
        assert "not being restarted" in page.text("banner") and "GPU is lost" in page.text("banner")
        gpu = page.text("gpu")
        for shown in ("NVIDIA H200", "87 °C", "80.0 of 141.0 GiB", "93 %", "sw_thermal",
                      "Last Xid79", "fail: Xid 79", "thermal slowdown"):
            assert shown in gpu, (shown, gpu)
        assert "no restart" in page.text("exits") and "gpu_fatal" in page.text("exits")
        assert page.text("supervisor-uptime") == "1h 02m"
        models = page.text("models")  # a row per model: here the one, the default
        assert Settings().engine.model_name in models and "failed" in models
        assert "default, pinned" in models
        assert page.text("quarantined").startswith("1: 0123456789abcdef (2 deaths, refused 0")
        assert not page.by_id("send").is_enabled()
        assert page.text("engine-canary") == "MISMATCH: " + CANARY["detail"]
        assert "canary-mismatch" in (page.by_id("engine-canary").get_attribute("class") or "")
        page.screenshot(artefacts / "gpu-failed.png")
        assert page.errors() == []
