"""What a restart costs with and without the worker template, on the real CPU worker, in one run.

    python -m load.bench.restart [--runs 3] [--template both|auto|off]
    python -m load.bench.restart --hangs [--prefill-only]


Per mode: cold `serve` -> /health 200, then `--runs` times kill -9 of the worker's server pid ->
/health 200 from a new worker, then `--runs` times SIGSTOP of EngineCore while a stream runs ->
the hang declared (/health not 200) and -> /health 200 from a new worker, all at the default
settings, each with the CPU seconds the new worker tree spent getting there
(less inflated by other work on the machine than wall time) and its phases from the appliance's
log, in seconds after the kill: stopped (the old tree reaped), started (forked or spawned),
core (EngineCore starts), engine (EngineCore ready), listening (vLLM's server up), ready. Then
the idle template's memory. One JSON object per line; the load average is in each, as every
phase slows with it.

--hangs: one appliance (template auto, default watch settings), and per case one freeze and
the seconds from it to the hang's declaration (/health leaves 200) and to a new worker's 200:
EngineCore or the worker's API server (the pid /health names) SIGSTOPped while idle (for a
frozen core, timed from the request that then arrives: nothing tells before), while a request
waits for its head (a ~1500-token prompt in prefill), and mid-stream. Then an ~8k-token prompt
that must not be declared a hang, with what the worker's /metrics showed during its prefill.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import psutil

from load.kit import results
from load.kit.appliance import Appliance, running_appliance, worker_tree
from supervisor.engine.stats import parse_engine_stats

# 2 x runs faults within minutes are a crash loop to the default guard (5 in 10 minutes, then
# `failed`); each fault here stands for one on its own, so the guard is set out of reach.
CRASH_LOOP_OFF = 100
STATE_PHASES = {"backoff": "stopped", "ready": "ready"}
LINE_PHASES = {  # the worker's own log lines
    "core": "Initializing a V1 LLM engine",
    "engine": "init engine (profile",
    "listening": "Starting vLLM server",
}


def emit(**fields: Any) -> None:
    print(json.dumps({**fields, "load": round(os.getloadavg()[0], 1)}), flush=True)


def ready_again(appliance: Appliance, old_pid: int, timeout_s: float = 600) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            health = appliance.health()
            if health.status_code == 200 and health.json()["pid"] != old_pid:
                return int(health.json()["pid"])
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"not ready after {timeout_s}s:\n{appliance.tail()}")


def tree_cpu_s(pid: int) -> float:
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    return round(sum(sum(p.cpu_times()[:2]) for p in tree), 1)


def phase_of(event: dict[str, Any]) -> str | None:
    name, line = event.get("event"), str(event.get("line", ""))
    if name == "engine.state":
        return STATE_PHASES.get(str(event.get("new")))
    if name in ("worker.forked", "worker.spawned"):
        return "started"
    if name == "worker.output":
        return next((phase for phase, text in LINE_PHASES.items() if text in line), None)
    return None


def phases(appliance: Appliance, killed_at: float) -> dict[str, float]:
    """Seconds from the kill (wall clock) to the first log event of each phase after it."""
    found: dict[str, float] = {}
    for event in appliance.log_events():
        at = datetime.fromisoformat(str(event["timestamp"]).replace("Z", "+00:00")).timestamp()
        phase = phase_of(event)
        if phase is not None and at >= killed_at and phase not in found:
            found[phase] = round(at - killed_at, 1)
    return found


def memory_mib(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        rows = [line.split() for line in rollup]
    return {row[0].rstrip(":"): int(row[1]) // 1024 for row in rows
            if row[0] in ("Rss:", "Pss:", "Private_Dirty:")}


def template_memory_mib(appliance: Appliance) -> dict[str, int]:
    for child in psutil.Process(appliance.proc.pid).children():
        if any("engine_side.py" in arg for arg in child.cmdline()):
            return memory_mib(child.pid)
    return {}


def worker_pss_mib(pid: int) -> int:
    """Proportional memory of the whole worker tree: what it really adds to the machine."""
    return sum(memory_mib(p)["Pss"] for p in worker_tree(pid))


def engine_core(worker_pid: int) -> psutil.Process:
    children = psutil.Process(worker_pid).children(recursive=True)
    return next(p for p in children if "EngineCore" in " ".join(p.cmdline()) + p.name())


@dataclass(frozen=True)
class Replaced:
    """A frozen worker's end, timed from the freeze: the hang declared (/health leaves 200),
    a new worker ready (its /health 200), its pid, and the exit cause /health then names."""

    declared_s: float
    ready_s: float
    pid: int
    cause: dict[str, Any]


def declared_and_replaced(appliance: Appliance, pid: int, began: float,
                          request: threading.Thread) -> Replaced:
    """Timed before `request` is waited for: a request that outlives the fault (replayed or
    resumed) ends well after the new worker is ready."""
    while appliance.health().status_code == 200:
        time.sleep(0.05)
    declared_s = time.monotonic() - began
    new = ready_again(appliance, pid)
    ready_s = time.monotonic() - began
    request.join(120)
    return Replaced(declared_s, ready_s, new, appliance.health().json().get("last_exit") or {})


def stream_story(url: str, started: threading.Event, ended: list[str]) -> None:
    body = {"messages": [{"role": "user", "content": "Write a long story."}],
            "max_tokens": 2000, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=300) as response:
        for line in response.iter_lines():
            started.set()
            if line:
                ended[:] = [line]


def sigstop_under_a_stream(appliance: Appliance, pid: int) -> tuple[int, dict[str, Any]]:
    """SIGSTOP of EngineCore with a stream in flight: seconds to the hang's declaration (the
    health endpoint leaves 200) and to a new worker's 200; the stream's last line."""
    started, ended = threading.Event(), [""]
    thread = threading.Thread(target=stream_story, args=(appliance.url, started, ended))
    thread.start()
    if not started.wait(120):
        raise RuntimeError("the stream never started")
    stopped_at, began = time.time(), time.monotonic()
    engine_core(pid).send_signal(signal.SIGSTOP)
    replaced = declared_and_replaced(appliance, pid, began, thread)
    return replaced.pid, {"sigstop_to_declared_s": round(replaced.declared_s, 1),
                 "sigstop_to_ready_s": round(replaced.ready_s, 1),
                 "reason": replaced.cause.get("reason"), "stream_last_line": ended[0][:80],
                 "phases": phases(appliance, stopped_at)}


def freeze(pid: int, target: str) -> int:
    """SIGSTOP of EngineCore ("core") or of the worker's API server ("server"); its pid."""
    victim = engine_core(pid).pid if target == "core" else pid
    os.kill(victim, signal.SIGSTOP)
    return victim


def post_chat(url: str, words: int, stream: bool, started: threading.Event,
              outcome: list[str], case: str) -> None:
    """A chat request of about `words` prompt tokens, read to its end (or its error); its
    outcome: the status, and for a stream whether it ended well ([DONE], no error event).
    Each case's body is its own: one body in flight at two engine deaths is quarantined."""
    content = f"{case}: " + "hello " * words
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 400,
            "stream": stream, "ignore_eos": True}
    try:
        with httpx.stream("POST", f"{url}/v1/chat/completions", json=body,
                          timeout=300) as answer:
            lines = []
            for line in answer.iter_lines():
                started.set()
                lines.append(line)
            failed = any(line.startswith('data: {"error"') for line in lines)
            ended = not stream or (bool(lines) and "data: [DONE]" in lines and not failed)
            outcome.append(f"{answer.status_code}{'' if ended else ' broken'}")
    except httpx.HTTPError as exc:
        outcome.append(type(exc).__name__)


def hang_case(appliance: Appliance, pid: int, target: str, during: str) -> tuple[int, dict[str, Any]]:
    """One freeze of `target` while `during` (idle, head, stream): seconds to the verdict and
    to a new worker's 200, timed from the freeze or, for a core frozen while idle, from the
    request that arrives 3 s after it (a request follows a frozen idle server too)."""
    started, outcome = threading.Event(), list[str]()
    words, stream = (1500, False) if during == "head" else (8, True)
    request = threading.Thread(target=post_chat,
                               args=(appliance.url, words, stream, started, outcome,
                                     f"{target} frozen during {during}"))
    if during == "idle":
        freeze(pid, target)
        began = time.monotonic()
        if target == "core":
            time.sleep(3)  # nothing tells while nothing waits on a frozen core: timed from
            began = time.monotonic()  # the request that then arrives
    request.start()
    if during == "stream" and not started.wait(120):
        raise RuntimeError("the stream never started")
    if during == "head":
        time.sleep(1)  # sent, in prefill: no byte of the answer yet
    if during != "idle":
        freeze(pid, target)
        began = time.monotonic()
    replaced = declared_and_replaced(appliance, pid, began, request)
    return replaced.pid, {"frozen": target, "during": during,
                          "declared_s": round(replaced.declared_s, 1),
                          "ready_s": round(replaced.ready_s, 1),
                          "request": outcome[0] if outcome else "unfinished",
                          "reason": replaced.cause.get("reason"),
                          "detail": str(replaced.cause.get("detail"))[:90]}


def long_prefill(appliance: Appliance, pid: int, tokens: int) -> dict[str, Any]:
    """A prompt of `tokens` tokens: how long before its answer, whether the worker stayed,
    and the worker's own /metrics each second while it ran (what a watch can see of it)."""
    model = appliance.engine_get("/v1/models").json()["data"][0]["id"]
    ids = appliance.engine_call("POST", "/tokenize", timeout_s=60, json={
        "model": model, "prompt": "hello world " * tokens,
        "add_special_tokens": False}).json()["tokens"][:tokens]
    prompt = appliance.engine_call("POST", "/detokenize", timeout_s=60, json={
        "model": model, "tokens": ids}).json()["prompt"]
    answers: list[httpx.Response] = []
    began = time.monotonic()
    sender = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{appliance.url}/v1/completions", timeout=600,
        json={"prompt": prompt, "max_tokens": 1, "temperature": 0})))
    sender.start()
    seen = []
    while sender.is_alive():
        with contextlib.suppress(httpx.HTTPError):
            stats = parse_engine_stats(appliance.engine_get("/metrics", timeout_s=5).text)
            seen.append((round(time.monotonic() - began), stats.running, stats.waiting,
                         stats.prompt_tokens, stats.iterations, tree_cpu_s(pid)))
        time.sleep(1)
    health = appliance.health().json()
    answer = answers[0] if answers else None
    return {"prefill_tokens": tokens, "status": answer.status_code if answer else None,
            "error": answer.text[:200] if answer is not None and answer.status_code != 200
            else None,
            "answered_s": round(time.monotonic() - began, 1),
            "same_worker": health["pid"] == pid and health["state"] == "ready",
            "metrics_during (s, running, waiting, prompt_tokens, iterations, tree_cpu_s)": seen}


def bench_hangs(prefill_only: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp, \
            running_appliance(Path(tmp), engine__max_model_len="8192",  # the model's own
                              crashes__dir=str(Path(tmp) / "crashes"),
                              supervisor__crash_loop_restarts=str(CRASH_LOOP_OFF)) as appliance:
        pid = int(str(appliance.wait_ready(timeout_s=900)["pid"]))
        for target in () if prefill_only else ("core", "server"):
            for during in ("idle", "head", "stream"):
                pid, result = hang_case(appliance, pid, target, during)
                emit(**result)
        emit(**long_prefill(appliance, pid, 8000))


def bench(mode: str, runs: int) -> None:
    with tempfile.TemporaryDirectory() as tmp, \
            running_appliance(Path(tmp), engine__template=mode,
                              supervisor__crash_loop_restarts=str(CRASH_LOOP_OFF)) as appliance:
        began = time.monotonic()
        pid = int(str(appliance.wait_ready(timeout_s=900)["pid"]))
        emit(template=mode, cold_serve_to_ready_s=round(time.monotonic() - began, 1),
             worker_pss_mib=worker_pss_mib(pid))
        for _ in range(runs):
            killed_at, began = time.time(), time.monotonic()
            os.kill(pid, signal.SIGKILL)
            old, pid = pid, ready_again(appliance, pid)
            emit(template=mode, kill_9_to_ready_s=round(time.monotonic() - began, 1),
                 worker_tree_cpu_s=tree_cpu_s(pid), orphans=worker_tree(old),
                 phases=phases(appliance, killed_at))
        for _ in range(runs):
            old, (pid, result) = pid, sigstop_under_a_stream(appliance, pid)
            emit(template=mode, **result, orphans=worker_tree(old))
        if mode == "auto":
            emit(template=mode, idle_template_mib=template_memory_mib(appliance))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--template", choices=["both", "auto", "off"], default="both")
    parser.add_argument("--hangs", action="store_true",
                        help="hang → verdict → ready per freeze, then an 8k-token prefill")
    parser.add_argument("--prefill-only", action="store_true", help="with --hangs: the prefill")
    results.add_option(parser)
    args = parser.parse_args(argv)
    with results.Printed() as printed:
        if args.hangs:
            bench_hangs(args.prefill_only)
        else:
            for mode in (["auto", "off"] if args.template == "both" else [args.template]):
                bench(mode, args.runs)
    results.save(__spec__.name, argv, printed.text(), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
