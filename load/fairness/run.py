"""Fair sharing of one engine, on the real CPU worker, in one run: ratios side by side.

    python -m load.fairness.run [--rounds 3] [--probes 12] [--interval 1.5] [--engine-threads 1]

Starts `chat-appliance serve` (real vLLM CPU worker) with named clients, then measures time to
first token (TTFT) of steady probe clients alone and under floods, alternating, `--rounds`
times, and prints each ratio next to its bar:

1. fairness: client A floods with 4x its max_inflight; client B's p50 and p95 TTFT stay within
   1.5x of B alone; A gets 429s; no 5xx anywhere.
2. priority, through the appliance: a low-priority client floods far beyond every slot (its
   requests wait in the admission queue); a high-priority client's TTFT stays within 2x of
   alone. A client of the flood's own priority is measured under the same flood, to show what
   the priority buys.
3. priority inside the engine: a low-priority backlog sent to the worker directly, larger than
   its max_num_seqs; a request with a better priority overtakes it (vLLM's priority scheduler),
   one with the backlog's priority waits behind it.
Exits 1 if a bar is missed, 2 if the appliance never became ready.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from appliance.fences.vllm import Env
from load.bench.stack import ROOT, Service, wait_http
from load.fairness.traffic import Sample, chat, under_flood
from load.kit import results
from load.kit.net import free_port
from supervisor.engine.stats import parse_engine_stats

LOW, HIGH = 10, -10  # vLLM priorities: lower is served first
KEYS = {name: f"sk-fairness-{name}" for name in ("a", "b", "high", "low", "peer")}


def clients(a_limit: int) -> list[dict[str, object]]:
    return [
        {"name": "a", "key": KEYS["a"], "max_inflight": a_limit},
        {"name": "b", "key": KEYS["b"]},
        {"name": "high", "key": KEYS["high"], "priority": HIGH},
        {"name": "low", "key": KEYS["low"], "priority": LOW},
        {"name": "peer", "key": KEYS["peer"], "priority": LOW},  # the flood's own priority
    ]


@dataclass
class Results:
    samples: dict[str, Sample] = field(default_factory=dict)

    def add(self, name: str, sample: Sample) -> None:
        self.samples.setdefault(name, Sample()).merge(sample)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="alone/flooded pairs per bar")
    parser.add_argument("--probes", type=int, default=12, help="probe requests per phase")
    parser.add_argument("--interval", type=float, default=1.5, help="seconds between probes")
    parser.add_argument("--probe-tokens", type=int, default=4)
    parser.add_argument("--flood-tokens", type=int, default=64)
    parser.add_argument("--slots", type=int, default=4, help="policy.max_inflight")
    parser.add_argument("--headroom", type=int, default=4,
                        help="admission.priority_headroom (the engine's max_num_seqs is "
                             "slots + headroom)")
    parser.add_argument("--a-limit", type=int, default=2, help="client A's max_inflight")
    parser.add_argument("--low-workers", type=int, default=16,
                        help="requests the low-priority flood keeps open")
    parser.add_argument("--ramp", type=float, default=2.0, help="flood head start, seconds")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="run the engine with this many OpenMP threads, unpinned (on a "
                             "shared, oversubscribed CPU pinned threads stall each other)")
    parser.add_argument("--out", type=Path, default=ROOT / "load" / "reports",
                        help="where the appliance's log and the JSON results go")
    results.add_option(parser)
    return parser.parse_args(argv)


def start(workdir: Path, args: argparse.Namespace) -> tuple[Service, str, str]:
    port, engine_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")} | {
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_ENGINE__PORT": str(engine_port),
        # Phase 3 sends its backlog to the worker directly, past the gate: the TCP fallback.
        "CHAT_APPLIANCE_ENGINE__LISTEN": "tcp",
        "CHAT_APPLIANCE_ENGINE__MAX_MODEL_LEN": "2048",
        "CHAT_APPLIANCE_ENGINE__MAX_NUM_SEQS": str(args.slots + args.headroom),
        "CHAT_APPLIANCE_ADMISSION__PRIORITY_HEADROOM": str(args.headroom),
        "CHAT_APPLIANCE_POLICY__MAX_INFLIGHT": str(args.slots),
        "CHAT_APPLIANCE_ADMISSION__QUEUE_MAX": "64",
        "CHAT_APPLIANCE_ADMISSION__QUEUE_WAIT_S": "60",
        "CHAT_APPLIANCE_ADMISSION__CLIENTS": json.dumps(clients(args.a_limit)),
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
        # A shared, oversubscribed CPU can take a 1-token canary past the default 20 s; a
        # restart would measure the restart, not the sharing.
        "CHAT_APPLIANCE_SUPERVISOR__CANARY_TIMEOUT_S": "120",
        "PYTHONPATH": str(ROOT),
    }
    if args.engine_threads:
        env["CHAT_APPLIANCE_ENGINE__ENV"] = json.dumps(
            {Env.CPU_OMP_THREADS_BIND: "nobind", "OMP_NUM_THREADS": str(args.engine_threads)})
    log_path = workdir / "fairness-appliance.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.main", "serve"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                start_new_session=True)
    return (Service("appliance", proc, log_path), f"http://127.0.0.1:{port}",
            f"http://127.0.0.1:{engine_port}")


@dataclass(frozen=True)
class Phase:
    """Probes of one client (`probe_body` as `probe_key`), alone or under a flood."""

    name: str
    target: str
    probe_key: str | None
    probe_body: dict[str, object]
    flood_key: str | None = None
    flood_body: dict[str, object] = field(default_factory=dict)
    workers: int = 0
    flood_name: str | None = None


async def settle(url: str, engine_url: str) -> int:
    """Until the engine is ready and nothing is in flight, here or in it (a phase must not
    inherit the last one's work); the engine's restart count then."""
    async with httpx.AsyncClient(timeout=10, trust_env=False) as client:
        for _ in range(3000):
            try:
                health = await client.get(f"{url}/health")
                engine = parse_engine_stats((await client.get(f"{engine_url}/metrics")).text)
                detail = health.json()
                if health.status_code == 200 and detail["in_flight"] == 0 and not engine.busy:
                    return int(detail["restarts"])
            except httpx.HTTPError:
                pass  # the worker restarting: the appliance's log says why
            await asyncio.sleep(0.1)  # polled: these counts have no event to wait on
    raise RuntimeError("the appliance did not settle within 300 s")


def run_phase(phase: Phase, args: argparse.Namespace, url: str, engine_url: str,
              results: Results) -> None:
    """One phase; run again (once) if the engine restarted meanwhile: that phase measured a
    restart, not sharing."""
    for attempt in (1, 2):
        restarts = asyncio.run(settle(url, engine_url))
        measured, flooded = asyncio.run(under_flood(
            phase.target, phase.probe_key, phase.probe_body, phase.flood_key, phase.flood_body,
            phase.workers, args.probes, args.interval, args.ramp))
        if asyncio.run(settle(url, engine_url)) == restarts or attempt == 2:
            break
        print(f"  {phase.name}: the engine restarted meanwhile; measuring again", flush=True)
    results.add(phase.name, measured)
    if phase.flood_name:
        results.add(phase.flood_name, flooded)
    print(f"  {phase.name}: TTFT p50 {_ms(measured.p(50))} ms, p95 {_ms(measured.p(95))} ms, "
          f"statuses {dict(measured.statuses)}", flush=True)


def phases(args: argparse.Namespace, url: str, engine_url: str) -> list[list[Phase]]:
    """The phases, in the groups whose ratios are compared."""
    probe, flood, workers = chat(args.probe_tokens, stream=True), chat(args.flood_tokens), \
        args.low_workers
    high, peer = chat(args.probe_tokens, HIGH, stream=True), chat(args.probe_tokens, LOW,
                                                                  stream=True)
    direct = chat(args.flood_tokens, LOW)  # to the worker itself: the priority in the body
    return [
        [Phase("b_alone", url, KEYS["b"], probe),
         Phase("b_flooded", url, KEYS["b"], probe, KEYS["a"], flood, 4 * args.a_limit,
               "a_flood")],
        [Phase("high_alone", url, KEYS["high"], probe),
         Phase("high_flooded", url, KEYS["high"], probe, KEYS["low"], flood, workers,
               "low_flood"),
         Phase("peer_flooded", url, KEYS["peer"], probe, KEYS["low"], flood, workers,
               "low_flood")],
        [Phase("engine_high", engine_url, None, high, None, direct, workers, "engine_flood"),
         Phase("engine_peer", engine_url, None, peer, None, direct, workers, "engine_flood")],
    ]


def run_rounds(args: argparse.Namespace, url: str, engine_url: str, results: Results) -> None:
    """Every phase once a round, each group in turn the other way round, so that a drift of
    the machine's speed weighs on both sides of a ratio alike."""
    for round_ in range(1, args.rounds + 1):
        print(f"round {round_}/{args.rounds}", flush=True)
        for group in phases(args, url, engine_url):
            for phase in group if round_ % 2 else reversed(group):
                run_phase(phase, args, url, engine_url, results)


def warm_up(args: argparse.Namespace, url: str, engine_url: str) -> None:
    """One untimed pass under each flood: the engine's first batches of a shape are slow."""
    quick = argparse.Namespace(**{**vars(args), "probes": 3, "interval": 0.2, "ramp": 1.0})
    groups = phases(quick, url, engine_url)
    for phase in (groups[0][1], groups[1][1]):
        run_phase(phase, quick, url, engine_url, Results())


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("inf")


@dataclass(frozen=True)
class Bar:
    what: str
    alone: Sample
    loaded: Sample
    limit: float  # the most loaded / alone may be, at p50 and p95

    def row(self) -> str:
        r50 = _ratio(self.loaded.p(50), self.alone.p(50))
        r95 = _ratio(self.loaded.p(95), self.alone.p(95))
        return (f"| {self.what} | {_ms(self.alone.p(50))} / {_ms(self.alone.p(95))} | "
                f"{_ms(self.loaded.p(50))} / {_ms(self.loaded.p(95))} | "
                f"**{r50:.2f}x / {r95:.2f}x** | {self.limit:g}x | {_mark(self.met)} |")

    @property
    def met(self) -> bool:
        return (_ratio(self.loaded.p(50), self.alone.p(50)) <= self.limit
                and _ratio(self.loaded.p(95), self.alone.p(95)) <= self.limit)


def _mark(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(results: Results, args: argparse.Namespace) -> bool:
    s = results.samples
    bars = [Bar("B, while A floods with 4x its max_inflight", s["b_alone"], s["b_flooded"], 1.5),
            Bar("high priority, under a low-priority flood", s["high_alone"],
                s["high_flooded"], 2.0)]
    seqs = args.slots + args.headroom
    print(f"\nTTFT, ms (p50 / p95); {args.rounds} rounds of {args.probes} probes, one every "
          f"{args.interval:g} s. policy.max_inflight {args.slots}, priority_headroom "
          f"{args.headroom}, engine max_num_seqs {seqs}. A: max_inflight {args.a_limit}, "
          f"{4 * args.a_limit} open. Low flood: {args.low_workers} open, "
          f"{args.flood_tokens} tokens each.\n")
    print("| client | alone | under flood | ratio p50 / p95 | bar | |")
    print("|---|---|---|---|---|---|")
    for bar in bars:
        print(bar.row())
    print(Bar("same priority as the flood (for contrast)", s["high_alone"], s["peer_flooded"],
              float("inf")).row())
    overtakes = engine_report(s["engine_high"], s["engine_peer"], args.low_workers, seqs)
    clean = statuses_report(s)
    return all(bar.met for bar in bars) and overtakes and clean


def engine_report(high: Sample, peer: Sample, backlog: int, seqs: int) -> bool:
    overtakes = _ratio(high.p(50), peer.p(50)) < 1
    print(f"\nInside the engine (the worker directly, {backlog} low-priority requests open, "
          f"max_num_seqs {seqs}): TTFT p50 with priority {HIGH} {_ms(high.p(50))} ms, with "
          f"the backlog's priority {LOW} {_ms(peer.p(50))} ms: the better priority overtakes, "
          f"{_ratio(peer.p(50), high.p(50)):.1f}x sooner: {_mark(overtakes)}")
    return overtakes


def statuses_report(samples: dict[str, Sample]) -> bool:
    refused = samples["a_flood"].statuses.get(429, 0)
    failures = {name: sample.failures for name, sample in samples.items() if sample.failures}
    print(f"\nA's flood: {dict(samples['a_flood'].statuses)}: 429s {_mark(refused > 0)}")
    print(f"low flood: {dict(samples['low_flood'].statuses)}; "
          f"engine flood: {dict(samples['engine_flood'].statuses)}")
    print(f"5xx or no answer, any client: {failures or 0}: {_mark(not failures)}")
    return refused > 0 and not failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with results.Printed() as printed:
        code = _measure(args)
    if code in (0, 1):  # a missed bar is a result; 2, a run that broke, is not
        results.save(__spec__.name, argv, printed.text(), args.results)
    return code


def _measure(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    service, url, engine_url = start(args.out, args)
    print(f"appliance log: {service.log_path}", flush=True)
    try:
        if not wait_http(service, f"{url}/health", 600):
            print(f"the appliance never became ready:\n{service.tail()}", file=sys.stderr)
            return 2
        results = Results()
        print("warm-up", flush=True)
        warm_up(args, url, engine_url)
        run_rounds(args, url, engine_url, results)
    finally:
        service.stop()
    passed = report(results, args)
    summary: dict[str, dict[str, object]] = {
        name: {"ttft_s": sample.ttft_s, "statuses": dict(sample.statuses)}
        for name, sample in results.samples.items()}
    (args.out / "fairness.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
