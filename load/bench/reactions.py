"""How soon the appliance reacts, on the real CPU worker, in one run: the timings the tests
leave out (on 2 shared cores a sub-second bar in a test measures the machine, not the code).

    python -m load.bench.reactions [--runs 3]

- abort: a client that leaves a 1500-token answer, streaming or not -> the engine runs no
  request (its own vllm:num_requests_running), in seconds and in decode steps of that same
  answer (tokens generated / seconds before the client left): the ratio is what a loaded
  machine cannot inflate, since a step slows down with it. The status page's Stop is this
  streaming case (the browser closes the connection).
- kill: kill -9 of the worker -> the first 503 with Retry-After a request gets, next to a
  /livez round trip measured just before it.
- stop: the API server's stop() -> serve() returned, next to the 1 s its main loop waits
  between ticks (what a stop that missed its wake-up would cost); no worker involved.

Each line of output is one JSON object; the summary is the median of each measure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from appliance.fences.uvicorn import ApiServer
from load.bench.cpu import start
from load.bench.stack import wait_http
from load.kit import results
from load.kit.net import free_port
from supervisor.engine.stats import EngineStats, parse_engine_stats

LONG = [{"role": "user", "content": "Write a very long essay about lighthouses."}]
MAIN_LOOP_WAIT_S = 1.0
NEVER_S = 120.0


def until(condition: Callable[[], bool], what: str, within_s: float = NEVER_S) -> float:
    """Poll until `condition`; the monotonic time it held."""
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} never happened")
        time.sleep(0.005)
    return time.monotonic()


def abort_run(url: str, engine: str, stream: bool) -> dict[str, Any]:
    def stats() -> EngineStats:
        return parse_engine_stats(httpx.get(f"{engine}/metrics", timeout=10).text)

    body = json.dumps({"messages": LONG, "max_tokens": 1500, "ignore_eos": True,
                       "stream": stream}).encode()
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: "
                 f"application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    before = stats()
    first = until(lambda: stats().generation_tokens >= before.generation_tokens + 2, "a token")
    at_first = stats().generation_tokens
    until(lambda: stats().generation_tokens >= at_first + 16, "16 more tokens")
    step_s = (time.monotonic() - first) / max(1.0, stats().generation_tokens - at_first)
    sock.close()
    left = time.monotonic()
    idle = until(lambda: stats().running == 0, "the abort")
    abort_s = idle - left
    return {"measure": "abort", "stream": stream, "abort_s": round(abort_s, 4),
            "step_s": round(step_s, 4), "steps": round(abort_s / step_s, 2)}


def kill_run(url: str) -> dict[str, Any]:
    pid = int(httpx.get(f"{url}/health", timeout=10).json()["pid"])
    began = time.monotonic()
    httpx.get(f"{url}/livez", timeout=10)
    livez_s = time.monotonic() - began
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()

    def refused() -> bool:
        response = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                              json={"messages": LONG, "max_tokens": 1})
        return response.status_code == 503 and "retry-after" in response.headers

    answered_s = until(refused, "a 503 after the kill") - killed
    until(lambda: _ready_with_another(url, pid), "a new worker", 600)
    return {"measure": "kill", "first_503_s": round(answered_s, 4),
            "livez_s": round(livez_s, 4), "ratio": round(answered_s / livez_s, 1)}


def _ready_with_another(url: str, old: int) -> bool:
    try:
        health = httpx.get(f"{url}/health", timeout=5)
    except httpx.HTTPError:
        return False
    return health.status_code == 200 and health.json().get("pid") != old


async def _stop_once() -> float:
    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        return None

    server = ApiServer(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_config=None,
                                    lifespan="off"))
    task = asyncio.create_task(server.serve())
    while not server.started:  # noqa: ASYNC110  (uvicorn's flag has no event to wait on)
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.3)  # inside one of the main loop's waits
    began = time.monotonic()
    server.stop()
    await task
    return time.monotonic() - began


def stop_run() -> dict[str, Any]:
    stop_s = asyncio.run(_stop_once())
    return {"measure": "stop", "stop_s": round(stop_s, 4),
            "ratio_to_main_loop_wait": round(stop_s / MAIN_LOOP_WAIT_S, 3)}


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def median(measure: str, key: str, **match: object) -> float:
        values = [r[key] for r in rows if r["measure"] == measure
                  and all(r.get(k) == v for k, v in match.items())]
        return round(float(statistics.median(values)), 4)

    return {"summary": True,
            "abort_stream_steps": median("abort", "steps", stream=True),
            "abort_stream_s": median("abort", "abort_s", stream=True),
            "abort_non_stream_steps": median("abort", "steps", stream=False),
            "abort_non_stream_s": median("abort", "abort_s", stream=False),
            "kill_first_503_s": median("kill", "first_503_s"),
            "kill_ratio_to_livez": median("kill", "ratio"),
            "stop_s": median("stop", "stop_s"),
            "load_average": os.getloadavg()[0]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="runs of each measure")
    results.add_option(parser)
    args = parser.parse_args(argv)
    return results.recorded(__spec__.name, argv, args.results, lambda: _measure(args))


def _measure(args: argparse.Namespace) -> int:
    rows = [stop_run() for _ in range(args.runs)]
    engine_port = free_port()
    with tempfile.TemporaryDirectory(prefix="bench-reactions-") as tmp:
        service, url = start(Path(tmp), engine_port)
        try:
            if not wait_http(service, f"{url}/health", 600):
                print(f"the appliance never became ready:\n{service.tail()}", file=sys.stderr)
                return 1
            engine = f"http://127.0.0.1:{engine_port}"
            for _ in range(args.runs):
                rows += [abort_run(url, engine, stream) for stream in (True, False)]
            rows += [kill_run(url) for _ in range(args.runs)]
        finally:
            service.stop()
    for row in [*rows, summary(rows)]:
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
