"""The running path against the real vLLM CPU worker: OpenAI SDK in, supervised engine behind."""

from __future__ import annotations

import contextlib
import os
import signal
import stat
import time
from datetime import datetime
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from appliance.fences.vllm import METRICS_PATH, Metric
from load.kit.appliance import Appliance, long_stream, running_appliance, worker_tree
from load.kit.isolation import clean_env
from supervisor.engine.stats import parse_engine_stats
from tests.metrics_text import samples, value


def client(appliance: Appliance) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{appliance.url}/v1", api_key="unused", max_retries=0)


def model_id(appliance: Appliance) -> str:
    return client(appliance).models.list().data[0].id


def test_chat_completion_through_the_sdk(appliance: Appliance) -> None:
    answer = client(appliance).chat.completions.create(
        model=model_id(appliance), max_tokens=16, temperature=0,
        messages=[{"role": "user", "content": "What is the capital of France?"}],
    )
    assert answer.choices[0].message.content
    assert answer.usage is not None and 0 < answer.usage.completion_tokens <= 16


def test_streamed_chat_completion_through_the_sdk(appliance: Appliance) -> None:
    stream = client(appliance).chat.completions.create(
        model=model_id(appliance), max_tokens=16, temperature=0, stream=True,
        messages=[{"role": "user", "content": "Count from one to five."}],
    )
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices]
    assert len(pieces) > 2
    assert "".join(pieces).strip()


def test_completion_stream_and_non_stream(appliance: Appliance) -> None:
    sdk, model = client(appliance), model_id(appliance)
    whole = sdk.completions.create(model=model, prompt="The sky is", max_tokens=8)
    assert whole.choices[0].text
    parts = [c.choices[0].text for c in sdk.completions.create(
        model=model, prompt="The sky is", max_tokens=8, stream=True) if c.choices]
    assert "".join(parts)


def test_request_id_is_taken_from_the_client_and_returned(appliance: Appliance) -> None:
    response = httpx.post(f"{appliance.url}/v1/completions", timeout=60,
                          headers={"X-Request-Id": "req-integration-42"},
                          json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "req-integration-42"
    deadline = time.monotonic() + 5  # the access line is written just after the last byte
    while not [e for e in appliance.log_events() if e.get("request_id") == "req-integration-42"]:
        assert time.monotonic() < deadline, "the request id is bound into the appliance's log lines"
        time.sleep(0.1)


def test_a_client_traceparent_tags_the_appliances_log_lines_with_its_trace_id(
        appliance: Appliance) -> None:
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    response = httpx.post(f"{appliance.url}/v1/completions", timeout=60,
                          headers={"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"},
                          json={"prompt": "Hello", "max_tokens": 2})
    assert response.status_code == 200
    request_id = response.headers["x-request-id"]
    deadline = time.monotonic() + 5  # the access line is written just after the last byte
    while not [e for e in appliance.log_events()
               if e.get("event") == "request.completed" and e.get("request_id") == request_id]:
        assert time.monotonic() < deadline, "no access line for the request"
        time.sleep(0.1)
    lines = [e for e in appliance.log_events() if e.get("request_id") == request_id]
    assert lines and all(e.get("trace_id") == trace_id for e in lines)


def test_health_reports_the_worker(appliance: Appliance) -> None:
    detail = appliance.health().json()
    assert detail["state"] == "ready"
    assert detail["pid"] and worker_tree(detail["pid"])
    events = appliance.log_events()
    # The pid is the worker's server the supervisor last started; the restarts are its deaths;
    # the uptime counts from when it last became ready (by the log's clock), not from the start.
    started = [e for e in events if e.get("event") in ("worker.spawned", "worker.forked")]
    assert detail["pid"] == started[-1]["pid"]
    deaths = [e for e in events if e.get("event") in ("engine.exited", "engine.boot_failed")]
    assert detail["restarts"] == len(deaths)
    ready = [e for e in events if e.get("event") == "engine.state" and e.get("new") == "ready"]
    since_ready = time.time() - datetime.fromisoformat(str(ready[-1]["timestamp"])).timestamp()
    assert abs(detail["uptime_s"] - since_ready) < 2, (detail["uptime_s"], since_ready)
    assert httpx.get(f"{appliance.url}/livez", timeout=5).status_code == 200


def test_the_progress_watch_reads_its_series_and_only_those_from_the_worker(
        appliance: Appliance) -> None:
    """The watch reads METRICS_PATH each second of work: the real worker answers it with every
    series progress needs, as its whole page has them, and with no other series."""
    page = samples(appliance.engine_get("/metrics").text)
    answer = appliance.engine_get(METRICS_PATH)
    assert answer.status_code == 200
    series = samples(answer.text)
    assert {name for name, _ in series} == set(Metric)
    assert set(series) <= set(page)
    assert len(answer.content) * 10 < len(appliance.engine_get("/metrics").content)
    assert parse_engine_stats(answer.text).prompt_tokens > 0  # the boot's canary was counted


def test_the_worker_listens_only_on_its_private_unix_socket(appliance: Appliance) -> None:
    """No other local user reaches the worker's routes past the gate: its server listens on no
    TCP port, only on a socket in a directory only the service user may enter. (EngineCore's
    own loopback listeners, torch.distributed's gloo transport, serve no HTTP route.)"""
    socket_path = appliance.engine_socket
    assert socket_path is not None and socket_path.is_socket()
    assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700
    server = psutil.Process(appliance.worker_pid())
    assert [c.laddr for c in server.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN] == []
    assert str(socket_path) in {c.laddr for c in server.net_connections(kind="unix")}
    with pytest.raises(httpx.ConnectError):  # the configured port is not served at all
        httpx.get(f"http://127.0.0.1:{appliance.engine_port}/health", timeout=5)
    assert appliance.engine_get("/health").status_code == 200  # the service user's way in


def test_kill_9_gives_503_at_once_streams_go_on_and_it_recovers(appliance: Appliance) -> None:
    old_pid = appliance.worker_pid()
    story = [{"role": "user", "content": "Write a long story about a lighthouse."}]
    reader, lines = long_stream(appliance, story, timeout_s=120, max_tokens=100)

    os.kill(old_pid, signal.SIGKILL)
    # Once the supervisor has seen the death (how soon is load.bench.reactions's), a new
    # request is refused at once with a 503 the client can act on, not a 502 or a 500, and
    # not held until the next worker is up. (One that slips in before it has seen the death is
    # sent to the next worker: test_resume.py's.)
    while (health := appliance.health()).status_code == 200:
        assert health.json()["pid"] == old_pid, "the worker came back before a 503 was seen"
        time.sleep(0.02)
    response = httpx.post(f"{appliance.url}/v1/chat/completions", timeout=60,
                          json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 503, response.text
    assert int(response.headers["retry-after"]) >= 1
    assert response.json()["error"]["code"] == "engine_unavailable"

    detail = appliance.wait_ready()
    assert detail["last_exit"]["reason"] == "exited"  # type: ignore[index]
    assert "SIGKILL" in detail["last_exit"]["detail"]  # type: ignore[index]
    assert detail["pid"] != old_pid and detail["restarts"] >= 1
    assert not worker_tree(old_pid), "no process of the killed worker's tree survives"
    # The stream in flight outlived the kill (resume): it goes on to its own end.
    reader.join(120)
    assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    assert sum(1 for line in lines if '"content":' in line) >= 90
    test_chat_completion_through_the_sdk(appliance)


@pytest.mark.parametrize("setting", [{"server__port": "not-a-port"}])
def test_bad_config_exits_2(tmp_path: Path, setting: dict[str, str]) -> None:
    import subprocess
    import sys

    env = clean_env()
    env |= {f"CHAT_APPLIANCE_{k.upper()}": v for k, v in setting.items()}
    result = subprocess.run([sys.executable, "-m", "supervisor.main", "serve"], env=env,
                            capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 2
    assert "server.port" in result.stderr


def test_metrics_count_a_known_sequence_exactly(appliance: Appliance) -> None:
    def scrape() -> str:
        return httpx.get(f"{appliance.url}/metrics", timeout=10).text

    route = {"route": "/v1/chat/completions"}
    before = scrape()
    sdk, model = client(appliance), model_id(appliance)
    hi = [{"role": "user", "content": "hi"}]
    for _ in range(2):
        sdk.chat.completions.create(model=model, messages=hi, max_tokens=2)  # type: ignore[arg-type]
    list(sdk.chat.completions.create(model=model, messages=hi, max_tokens=2,  # type: ignore[arg-type]
                                     stream=True))
    with pytest.raises(openai.BadRequestError):
        sdk.chat.completions.create(model=model, messages=hi, n=5)  # type: ignore[arg-type]
    after = scrape()

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("appliance_requests_total", status="200", **route) == 3
    assert delta("appliance_requests_total", status="400", **route) == 1
    assert delta("appliance_rejections_total", reason="n_cap") == 1
    assert delta("appliance_time_to_first_token_seconds_count", **route) == 1
    assert value(after, "appliance_engine_state", state="ready") == 1
    assert value(after, "appliance_requests_in_flight") == 0
    assert any(name == "appliance_engine_kv_cache_usage_ratio" and dict(labels).get("model")
               for name, labels in samples(after))  # labelled with its model


def test_status_command_describes_the_running_appliance(appliance: Appliance) -> None:
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "supervisor.main", "status", "--url",
                             appliance.url], capture_output=True, text=True, timeout=30,
                            check=False)
    assert result.returncode == 0, result.stderr
    assert "engine:   ready" in result.stdout and "restarts:" in result.stdout


def test_a_worker_that_never_boots_is_told_apart_and_backs_off(tmp_path: Path) -> None:
    """A bad model path: the real vLLM exits during boot; /health names it a boot failure."""
    with running_appliance(tmp_path, engine__model=str(tmp_path / "no-such-model"),
                           supervisor__crash_loop_restarts="2") as appliance:
        deadline = time.monotonic() + 240
        detail: dict = {}
        while detail.get("state") != "failed":
            assert time.monotonic() < deadline, f"never went failed: {detail}"
            time.sleep(1)
            with contextlib.suppress(httpx.ConnectError):  # the API may not listen yet
                detail = appliance.health().json()
        assert appliance.health().status_code == 503
        assert detail["last_exit"]["phase"] == "boot"
        assert detail["last_exit"]["detail"].startswith("never became ready: exit ")
        events = [e["event"] for e in appliance.log_events()]
        assert "engine.boot_failed" in events and "engine.exited" not in events
        refused = httpx.post(f"{appliance.url}/v1/completions", json={"prompt": "x"}, timeout=10)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 5
