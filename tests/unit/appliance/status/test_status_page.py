"""The status page's shell (/ and its assets) and its data (/status.json), over a fake engine."""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from litestar import Litestar

from appliance.app import create_app
from appliance.core.engine import EngineState
from appliance.core.sections import ResumeSettings
from appliance.core.settings import Settings
from appliance.recovery.quarantine import Quarantine
from tests.unit.appliance.fakes import FakeEngine, FakeReading

pytestmark = pytest.mark.anyio
EXIT = {"phase": "running", "reason": "exited", "detail": "crashed after ready: SIGKILL",
        "at": 1_700_000_000.0, "restart": {"stop_s": 0.1, "backoff_s": 0.5, "boot_s": 30.0,
                                           "total_s": 30.6}}


class ExitedEngine(FakeEngine):
    def snapshot(self) -> dict[str, Any]:
        return super().snapshot() | {"last_exit": EXIT, "recent_exits": [EXIT]}


async def get(app: Litestar, path: str, **kwargs: Any) -> httpx.Response:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        return await client.get(path, **kwargs)


async def test_the_shell_loads_only_its_own_assets_under_a_strict_policy() -> None:
    """Works on a LAN without internet: no CDN, no absolute URL, nothing inline to run."""
    app = create_app(Settings(), FakeEngine("http://127.0.0.1:9"))
    page = await get(app, "/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "default-src 'self'" in page.headers["content-security-policy"]
    html = page.text
    referenced = re.findall(r'(?:src|href)="([^"]+)"', html)
    assert set(referenced) == {"/ui/status.css", "/ui/status.js", "/ui/chart.js", "data:,"}
    assert "<script>" not in html and "style=" not in html  # the policy would block them
    for path, kind in (("/ui/status.js", "text/javascript"), ("/ui/chart.js", "text/javascript"),
                       ("/ui/status.css", "text/css")):
        asset = await get(app, path)
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert not re.search(r"https?://", asset.text), f"{path} reaches outside the appliance"


async def test_the_api_key_is_kept_in_session_storage_and_sent_only_as_a_header() -> None:
    script = (await get(create_app(Settings(), FakeEngine("http://127.0.0.1:9")),
                        "/ui/status.js")).text
    assert "sessionStorage.setItem(KEY_STORE" in script
    assert "localStorage" not in script and "?key=" not in script and "location" not in script
    assert 'Authorization: "Bearer " + apiKey' in script


@pytest.mark.parametrize("state", list(EngineState))
async def test_status_json_answers_200_in_every_engine_state(state: EngineState) -> None:
    """A page that polls must see the restart, not errors; scripts read engine.state."""
    app = create_app(Settings(), ExitedEngine("http://127.0.0.1:9", state=state))
    response = await get(app, "/status.json")
    assert response.status_code == 200
    doc = response.json()
    assert doc["engine"]["state"] == state.value
    assert doc["engine"]["recent_exits"] == [EXIT]
    assert response.headers["cache-control"] == "no-store"


async def test_status_json_counts_requests_and_reads_the_engines_own_queue() -> None:
    reading = FakeReading(running=2, waiting=5, generation_tokens=100)
    app = create_app(Settings(policy={"max_inflight": 8}), FakeEngine("http://127.0.0.1:9"),
                     engine_reading=lambda: reading)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                 base_url="http://localhost") as client:
        refused = await client.post("/v1/completions", json={"prompt": "x", "n": 9})
        assert refused.status_code == 400
        doc = (await client.get("/status.json")).json()
    requests = doc["requests"]
    assert requests["rejected"] == {"n_cap": 1.0}
    assert (requests["in_flight"], requests["max_inflight"]) == (0, 8)
    assert (requests["engine_running"], requests["engine_waiting"]) == (2, 5)
    assert doc["refresh_s"] == Settings().status.refresh_s
    assert set(doc["recent"]["series"]) == {"t", "tokens_per_s", "ttft_s", "in_flight"}


async def test_status_json_follows_protect_ops_routes_and_the_shell_does_not() -> None:
    settings = Settings(server={"api_keys": ["sk-status"], "protect_ops_routes": True})
    app = create_app(settings, FakeEngine("http://127.0.0.1:9"))
    assert (await get(app, "/status.json")).status_code == 401
    auth = {"authorization": "Bearer sk-status"}
    assert (await get(app, "/status.json", headers=auth)).status_code == 200
    assert (await get(app, "/")).status_code == 200


@pytest.mark.parametrize(("path", "content_type"), [
    ("/", "text/html; charset=utf-8"), ("/ui/status.js", "text/javascript; charset=utf-8"),
    ("/ui/chart.js", "text/javascript; charset=utf-8"), ("/ui/status.css", "text/css; charset=utf-8")])
async def test_the_shell_and_its_assets_name_their_charset_once(path: str, content_type: str) -> None:
    asset = await get(create_app(Settings(), FakeEngine("http://127.0.0.1:9")), path)
    assert asset.headers["content-type"] == content_type


async def test_status_json_shows_the_quarantined_fingerprints_and_the_page_renders_them() -> None:
    quarantine = Quarantine(ResumeSettings())
    app = create_app(Settings(), FakeEngine("http://127.0.0.1:9"), quarantine=quarantine)
    assert (await get(app, "/status.json")).json()["requests"]["quarantined"]["count"] == 0
    quarantine.died(["fp-poison", "fp-bystander"])
    quarantine.died(["fp-poison"])
    held = (await get(app, "/status.json")).json()["requests"]["quarantined"]
    assert held["count"] == 1 and held["after_deaths"] == 2
    assert [(e["fingerprint"], e["deaths"]) for e in held["newest"]] == [("fp-poison", 2)]
    script = (await get(app, "/ui/status.js")).text
    assert 'renderQuarantined(requests.quarantined)' in script
    assert 'id="quarantined"' in (await get(app, "/")).text
