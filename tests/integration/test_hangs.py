"""A hang seen in seconds whatever the engine was doing, and the bundle each death leaves,
against the real vLLM CPU worker (one boot, default watch settings but a shorter stall bound;
faults restart by fork).

The bound asserted is loose on purpose (two shared cores): the bar, 10 s, is measured by
`python -m load.bench.restart --hangs`; these fail on the old behaviour (47 s through the idle
canary; 34 s through three /health timeouts).
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from appliance.fences.vllm import METRICS_PATH
from load.kit.appliance import Appliance, long_stream, running_appliance, worker_tree
from supervisor.engine.stats import EngineStats, parse_engine_stats

GUARD_S = 20  # declared well before the old 34-47 s, with room for a loaded machine
# Below the default (5 s) so that the longest prefill the window allows outlasts it on a fast CI
# machine too; a hang is still declared from the other signs (no CPU used, no runnable thread).
STALL_S = 2.0
READ_EVERY_S = 0.2  # the long prefill's reads of the worker's counters
STORY = [{"role": "user", "content": "Write a long story about a lighthouse keeper."}]


@pytest.fixture(scope="module")
def watched(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Appliance, Path]]:
    root = Path(tmp_path_factory.mktemp("hangs"))
    crashes = root / "crashes"
    # Resume off: what a hang does to the requests it meets, as the client sees it without
    # resume (test_resume.py shows them outliving it).
    with running_appliance(root, crashes__dir=str(crashes), resume__enabled="false",
                           supervisor__crash_loop_restarts="100",
                           supervisor__hang_stall_s=str(STALL_S)) as appliance:
        appliance.wait_ready()
        yield appliance, crashes


def engine_core(worker_pid: int) -> psutil.Process:
    children = psutil.Process(worker_pid).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name())


def declared_after(appliance: Appliance, since: float) -> float:
    """Seconds from `since` until /health leaves 200."""
    while appliance.health().status_code == 200:
        assert time.monotonic() - since < 120, "the hang was never declared"
        time.sleep(0.1)
    return time.monotonic() - since


def crashes_command(crashes: Path, *args: str) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")}
    env["CHAT_APPLIANCE_CRASHES__DIR"] = str(crashes)
    result = subprocess.run([sys.executable, "-m", "supervisor.main", "crashes", *args],
                            env=env, capture_output=True, text=True, timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout


def newest_bundle(crashes: Path, count: int) -> dict[str, object]:
    deadline = time.monotonic() + 60
    while len(names := sorted(crashes.glob("*.json"))) < count:
        assert time.monotonic() < deadline, f"{len(names)} bundles, expected {count}"
        time.sleep(0.2)
    return dict(json.loads(names[-1].read_text()))


def test_engine_core_frozen_while_idle_is_hung_once_a_request_waits(
        watched: tuple[Appliance, Path]) -> None:
    """EngineCore SIGSTOPped while idle: its gauges stay "idle", but the chat request the
    appliance sent it is work; declared long before the idle canary, and the bundle names the
    request (not its body) with the frozen processes' stacks."""
    appliance, crashes = watched
    old = int(appliance.wait_ready()["pid"])
    before = len(list(crashes.glob("*.json")))
    core = engine_core(old).pid
    os.kill(core, signal.SIGSTOP)
    time.sleep(3)  # idle and frozen: nothing tells yet
    answers: list[httpx.Response] = []
    secret = "the-secret-prompt-text"
    sender = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{appliance.url}/v1/chat/completions", timeout=120,
        json={"messages": [{"role": "user", "content": secret}], "max_tokens": 4})))
    sent = time.monotonic()
    sender.start()
    declared_s = declared_after(appliance, sent)
    sender.join(60)
    assert answers and answers[0].status_code == 503  # before its head: unavailable
    detail = appliance.wait_ready()
    assert detail["pid"] != old and not worker_tree(old)
    assert detail["last_exit"]["reason"] == "hung"  # type: ignore[index]
    print(f"engine core frozen while idle: declared {declared_s:.1f} s after the request")
    assert declared_s < GUARD_S
    bundle = newest_bundle(crashes, before + 1)
    assert bundle["pid"] == old and bundle["cause"]["reason"] == "hung"  # type: ignore[index]
    [request] = bundle["in_flight"]  # type: ignore[misc]
    assert request["route"] == "/v1/chat/completions" and request["body_bytes"] > 0
    assert secret not in json.dumps(bundle)
    stacks = bundle["stacks"]
    assert isinstance(stacks, dict) and str(old) in stacks and len(stacks) >= 2
    assert str(core) in stacks and f"{core} " in stacks[str(core)]  # its threads, from /proc
    assert " T " in stacks[str(core)]  # stopped, as dumped before the kill
    assert detail["last_crash"] == sorted(crashes.glob("*.json"))[-1].stem


def test_api_server_frozen_mid_stream_is_hung_at_its_first_unanswered_probe(
        watched: tuple[Appliance, Path]) -> None:
    """SIGSTOP of the pid /health names while a stream runs (what `load.locust.run --chaos` does):
    the server neither answers nor runs; the stream ends with an error event."""
    appliance, _ = watched
    old = int(appliance.wait_ready()["pid"])
    reader, lines = long_stream(appliance, STORY, timeout_s=180)
    os.kill(old, signal.SIGSTOP)
    declared_s = declared_after(appliance, time.monotonic())
    reader.join(60)
    assert lines[-1] == "data: [DONE]" and '"error"' in lines[-2]
    detail = appliance.wait_ready()
    assert detail["pid"] != old and not worker_tree(old)
    assert "did not answer" in detail["last_exit"]["detail"]  # type: ignore[index]
    print(f"API server frozen mid-stream: declared {declared_s:.1f} s after SIGSTOP")
    assert declared_s < GUARD_S


def test_kill_9_leaves_one_bundle_that_the_crashes_command_shows(
        watched: tuple[Appliance, Path]) -> None:
    appliance, crashes = watched
    old = int(appliance.wait_ready()["pid"])
    before = len(list(crashes.glob("*.json")))
    os.kill(old, signal.SIGKILL)
    detail = appliance.wait_ready()
    bundle = newest_bundle(crashes, before + 1)
    assert len(list(crashes.glob("*.json"))) == before + 1
    assert bundle["pid"] == old and bundle["stacks"] is None  # nothing left to dump
    assert "SIGKILL" in bundle["cause"]["detail"]  # type: ignore[index]
    assert bundle["log_tail"], "the worker's last output lines"
    name = str(detail["last_crash"])
    assert name in crashes_command(crashes)
    shown = crashes_command(crashes, "last")
    assert f"pid {old}" in shown and "SIGKILL" in shown
    assert "total_s" in crashes_command(crashes, name, "--json")  # the restart's timings


def test_a_long_prefill_is_not_a_hang(watched: tuple[Appliance, Path]) -> None:
    """The longest prompt the window allows, a request the appliance has waiting on the
    worker with no token for as long as the prefill runs: the engine's progress counters stand
    still for longer than `hang_stall_s` while it is busy, and the same worker answers it."""
    appliance, _ = watched
    before = appliance.wait_ready()
    ids = list(range(1000, 1000 + 1900))  # ordinary vocabulary ids: about 1900 prompt tokens
    prompt = appliance.engine_call("POST", "/detokenize", timeout_s=60, json={
        "model": _model(appliance), "tokens": ids}).json()["prompt"]
    done = threading.Event()
    samples: list[tuple[float, EngineStats]] = []

    def watch() -> None:  # the worker's own counters, as the progress watch reads them
        while not done.is_set():
            samples.append((time.monotonic(), parse_engine_stats(
                appliance.engine_get(METRICS_PATH).text)))
            time.sleep(READ_EVERY_S)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        response = httpx.post(f"{appliance.url}/v1/completions", timeout=600,
                              json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    finally:
        done.set()
        watcher.join(30)
    assert response.status_code == 200, response.text[:300]
    after = appliance.health().json()
    # Less one read's interval: the first read may come just before the request is sent.
    still_s = longest_stillness(samples) - READ_EVERY_S
    print(f"prefill: the engine's counters stood still {still_s:.1f} s with the request in it")
    assert still_s > STALL_S, "the prefill never reached the stall bound"
    assert (after["pid"], after["restarts"]) == (before["pid"], before["restarts"])


def longest_stillness(samples: list[tuple[float, EngineStats]]) -> float:
    """The longest span between two reads whose progress counters did not move in between.
    (Not the engine's busy gauges: vLLM records them, as the counters, only when a step yields
    output, so a prefill may leave them at idle; the watch counts the appliance's own requests
    waiting on the worker as busy, and these reads are taken only while one is.)"""
    longest, since = 0.0, None
    for (then, earlier), (now, stats) in itertools.pairwise(samples):
        if stats.progress == earlier.progress:
            since = then if since is None else since
            longest = max(longest, now - since)
        else:
            since = None
    return longest


def _model(appliance: Appliance) -> str:
    return str(httpx.get(f"{appliance.url}/v1/models", timeout=10).json()["data"][0]["id"])
