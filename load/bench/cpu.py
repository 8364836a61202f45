"""What the appliance costs next to vLLM's own API server, on the real worker, in one run.

    python -m load.bench.cpu [--requests 48] [--concurrency 8] [--tokens 32] [--rounds 2]
                             [--compare-resume | --baseline CHECKOUT] [--swap]

Starts `chat-appliance serve` with the real vLLM CPU worker, then sends the same closed-loop
load through the appliance, streaming and not, and reads the CPU seconds each process used
meanwhile: the appliance's own process (API, supervisor, monitors), vLLM's API-server process
(the worker's leader) and its EngineCore (the model). The result is the ratio of CPU per request,
appliance / vLLM API server: the gateway must never be what saturates first. CPU time is read
from each process's CPU clock, to the nanosecond (/proc's ticks are 10 ms, a tenth of a phase's
appliance CPU); the appliance's is also split by thread: its serving loop, and the rest (the
probes' thread, mostly).

Both processes also spend CPU with no request at all: the appliance watches its worker (health
probes, the engine processes' CPU time, the idle canary, the status sampler) and vLLM's server
answers those and runs its own loops. While requests run, the appliance also reads the engine's
/metrics each second for hang detection, and vLLM's server spends CPU answering it (counted in
its column: it is what the deployment costs). That cost is per second, not per request: it is
measured in an idle window before the rounds and after them, reported as ms/s, and the table
shows the ratio both as measured and above that idle cost.

With --compare-resume two appliances run side by side, each with its own worker: one with
`resume.enabled` (the default: streams ask for their token ids and keep them) and one without;
their rounds alternate, and a table each shows what keeping a request resumable costs.

With --baseline CHECKOUT the other appliance is another checkout's code (say main's: `git
worktree add /tmp/base main`, with its .engine-venv and .models linked as install.sh does),
run by this venv's interpreter: a change's cost, measured side by side in one run. The two
slots are not alike: on the shared 2-core test box, in two runs with the checkouts swapped, the
appliance started first cost 8-36% more CPU per request and its EngineCore 5-18% more,
whichever code it ran; so run it twice, the second time with --swap (the appliances started in the
other order), and take the two runs' ratios together; --compare-resume the same.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from load.bench.stack import ROOT, Service, wait_http
from load.kit import results
from load.kit.net import free_port
from load.kit.procstat import cpu_ns, thread_cpu_ns

PROMPT = [{"role": "user", "content": "Tell me about the sea."}]


@dataclass
class Phase:
    name: str
    requests: int
    wall_s: float
    appliance_s: float
    api_server_s: float
    engine_s: float
    off_loop_s: float  # the appliance's, in threads other than its serving loop's

    def row(self, idle: Idle) -> str:
        per = 1000 / self.requests
        appliance = self.appliance_s - idle.appliance_per_s * self.wall_s
        server = self.api_server_s - idle.api_server_per_s * self.wall_s
        return (f"| {self.name} | {self.requests} | {self.wall_s:.1f} | "
                f"{self.appliance_s * per:.2f} | {self.off_loop_s * per:.2f} | "
                f"{self.api_server_s * per:.2f} | "
                f"{self.engine_s * per:.1f} | **{_ratio(self.appliance_s, self.api_server_s)}** | "
                f"{appliance * per:.2f} | {server * per:.2f} | **{_ratio(appliance, server)}** |")


def pooled(name: str, phases: list[Phase]) -> Phase:
    return Phase(name, sum(p.requests for p in phases), sum(p.wall_s for p in phases),
                 sum(p.appliance_s for p in phases), sum(p.api_server_s for p in phases),
                 sum(p.engine_s for p in phases), sum(p.off_loop_s for p in phases))


@dataclass
class Idle:
    appliance_per_s: float
    api_server_per_s: float
    off_loop_per_s: float = 0.0


@dataclass(frozen=True)
class Reading:
    """CPU seconds so far: the appliance's (and, of it, off its serving loop), its worker's API
    server's and EngineCore's."""

    appliance: float
    off_loop: float
    api_server: float
    engine: float

    @classmethod
    def of(cls, pids: tuple[int, int, list[int]]) -> Reading:
        appliance, server, engine = pids
        total = cpu_ns(appliance)
        loop = thread_cpu_ns(appliance).get(appliance, 0)  # its main thread runs the loop
        return cls(total / 1e9, (total - loop) / 1e9, cpu_ns(server) / 1e9,
                   sum(cpu_ns(p) for p in engine) / 1e9)


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 0 else "n/a"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=48, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="max_tokens of each answer")
    parser.add_argument("--rounds", type=int, default=2, help="stream/non-stream pairs")
    parser.add_argument("--idle-s", type=float, default=20.0,
                        help="seconds of each idle window (before and after the rounds)")
    other = parser.add_mutually_exclusive_group()
    other.add_argument("--compare-resume", action="store_true",
                       help="an appliance with resume off next to the default one")
    other.add_argument("--baseline", type=Path, metavar="CHECKOUT",
                       help="another checkout's appliance next to this tree's")
    parser.add_argument("--swap", "--baseline-first", action="store_true",
                        help="start the second appliance first (the baseline, or the one with "
                             "resume off), in the slot the other had")
    results.add_option(parser)
    return parser.parse_args(argv)


def start(workdir: Path, engine_port: int | None = None,
          settings: dict[str, str] | None = None, root: Path = ROOT) -> tuple[Service, str]:
    """serve with the real worker and its URL: on its private Unix socket, or, where the
    caller reads the worker itself, on loopback `engine_port`; `settings` as environment;
    the code of the checkout at `root`."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHAT_APPLIANCE_")} | {
        "CHAT_APPLIANCE_SERVER__PORT": str(port),
        "CHAT_APPLIANCE_SERVER__HOST": "127.0.0.1",
        "CHAT_APPLIANCE_ENGINE__PORT": str(engine_port or free_port()),
        "CHAT_APPLIANCE_ENGINE__MAX_MODEL_LEN": "2048",
        "CHAT_APPLIANCE_LOGGING__FORMAT": "json",
        "PYTHONPATH": str(root),
    } | (settings or {})
    if engine_port is not None:  # else its default, a Unix socket (a baseline from before
        env["CHAT_APPLIANCE_ENGINE__LISTEN"] = "tcp"  # a48c0a0 knows no such setting: TCP)
    workdir.mkdir(parents=True, exist_ok=True)
    log_path = workdir / "appliance.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "supervisor.main", "serve"], stdout=log,
                                stderr=subprocess.STDOUT, env=env, cwd=root,
                                start_new_session=True)
    return Service("appliance", proc, log_path), f"http://127.0.0.1:{port}"


async def drive(url: str, stream: bool, requests: int, concurrency: int, tokens: int,
                headers: dict[str, str] | None = None) -> None:
    body = {"messages": PROMPT, "max_tokens": tokens, "ignore_eos": True, "stream": stream}
    queue = list(range(requests))

    async def user(client: httpx.AsyncClient) -> None:
        while queue:
            queue.pop()
            if stream:
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200, await response.aread()
                    async for _ in response.aiter_bytes():
                        pass
            else:
                response = await client.post("/v1/chat/completions", json=body)
                assert response.status_code == 200, response.text

    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600,
                                 trust_env=False) as client:
        await asyncio.gather(*(user(client) for _ in range(concurrency)))


def measure(name: str, url: str, pids: tuple[int, int, list[int]], args: argparse.Namespace,
            stream: bool) -> Phase:
    before, started = Reading.of(pids), time.monotonic()
    asyncio.run(drive(url, stream, args.requests, args.concurrency, args.tokens))
    after, wall = Reading.of(pids), time.monotonic() - started
    return Phase(name, args.requests, wall, after.appliance - before.appliance,
                 after.api_server - before.api_server, after.engine - before.engine,
                 after.off_loop - before.off_loop)


def idles(all_pids: list[tuple[int, int, list[int]]], seconds: float) -> list[Idle]:
    """Each appliance's and its server's CPU per second with no request, in one window."""
    before = [Reading.of(pids) for pids in all_pids]
    time.sleep(seconds)
    return [Idle((b.appliance - a.appliance) / seconds, (b.api_server - a.api_server) / seconds,
                 (b.off_loop - a.off_loop) / seconds)
            for a, b in zip(before, [Reading.of(pids) for pids in all_pids], strict=True)]


@dataclass
class Run:
    """One appliance under test: its label, URL and processes, and what was measured."""

    label: str
    url: str
    pids: tuple[int, int, list[int]]
    idles: list[Idle]
    phases: list[Phase]


CONFIGS = {"default": {}, "resume off": {"CHAT_APPLIANCE_RESUME__ENABLED": "false"}}


def appliances(args: argparse.Namespace) -> list[tuple[str, Path, dict[str, str]]]:
    """(label, checkout, settings) of each appliance to run side by side."""
    if args.compare_resume:
        pair: list[tuple[str, Path, dict[str, str]]] = [
            (label, ROOT, settings) for label, settings in CONFIGS.items()]
    elif args.baseline is not None:
        base = args.baseline.resolve()
        pair = [(f"this tree ({ROOT})", ROOT, {}), (f"baseline ({base})", base, {})]
    else:
        return [("default", ROOT, {})]
    return pair[::-1] if args.swap else pair


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return results.recorded(__spec__.name, argv, args.results, lambda: _measure(args))


def _measure(args: argparse.Namespace) -> int:
    runs: list[Run] = []
    services: list[Service] = []
    with tempfile.TemporaryDirectory(prefix="bench-cpu-") as tmp:
        try:
            for n, (label, root, settings) in enumerate(appliances(args)):
                service, url = start(Path(tmp) / str(n), settings=settings, root=root)
                services.append(service)
                if not wait_http(service, f"{url}/health", 600):
                    print(f"the appliance never became ready:\n{service.tail()}", file=sys.stderr)
                    return 1
                worker = int(httpx.get(f"{url}/health", timeout=5).json()["pid"])
                engine = [p.pid for p in psutil.Process(worker).children(recursive=True)]
                runs.append(Run(label, url, (service.proc.pid, worker, engine), [], []))
            for run in runs:
                measure("warm-up", run.url, run.pids, args, stream=True)
            for run, measured in zip(runs, idles([r.pids for r in runs], args.idle_s), strict=True):
                run.idles.append(measured)
            for n in range(args.rounds):
                # Alternating, and in turn first: each appliance meets the same conditions.
                for run in runs if n % 2 == 0 else runs[::-1]:
                    run.phases.append(measure("streaming", run.url, run.pids, args, stream=True))
                    run.phases.append(measure("non-streaming", run.url, run.pids, args,
                                              stream=False))
            for run, measured in zip(runs, idles([r.pids for r in runs], args.idle_s), strict=True):
                run.idles.append(measured)
        finally:
            for service in services:
                service.stop()
    for run in runs:
        report(run, args)
    if len(runs) > 1:
        compare(runs)
    return 0


def report(run: Run, args: argparse.Namespace) -> None:
    print(f"\n## {run.label}: {args.requests} requests per phase, {args.concurrency} concurrent, "
          f"{args.tokens} tokens each; CPU ms per request\n")
    base = Idle(*(sum(getattr(i, name) for i in run.idles) / len(run.idles)
                  for name in ("appliance_per_s", "api_server_per_s", "off_loop_per_s")))
    print(f"idle, no request ({args.idle_s:.0f} s before and after the rounds): appliance "
          f"{base.appliance_per_s * 1000:.2f} ms/s ({base.off_loop_per_s * 1000:.2f} off its "
          f"serving loop), vLLM API server {base.api_server_per_s * 1000:.2f} ms/s\n")
    print("| phase | requests | wall s | appliance | of it off the serving loop | "
          "vLLM API server | EngineCore | appliance / API server | appliance above idle | "
          "API server above idle | ratio above idle |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for phase in run.phases:
        print(phase.row(base))
    # Every round of a mode pooled: the CPU clocks are exact, but what else the box runs
    # meanwhile (caches, a core's turn) moves one phase's figures more than the pooled ones.
    for name in ("streaming", "non-streaming"):
        print(pooled(f"all {name} rounds", [p for p in run.phases if p.name == name]).row(base))
    print(json.dumps({"label": run.label, "idle": [i.__dict__ for i in run.idles],
                      "phases": [phase.__dict__ for phase in run.phases]}))


def compare(runs: list[Run]) -> None:
    """Each run's appliance next to the first run's, every round of a mode pooled and its median
    round: CPU per request; the whole box's share (appliance and API server together, since a
    change may move work between them); and off the serving loop per second, which is where
    the probes' cost shows (they cost per second of work, not per request)."""
    print("\n## side by side: CPU ms per request (pooled, median round), and per second\n")
    print("| appliance | mode | appliance | median round | appliance + API server | "
          "appliance / API server | appliance vs the first | off the serving loop, ms/s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in ("streaming", "non-streaming"):
        first = pooled(name, [p for p in runs[0].phases if p.name == name])
        for run in runs:
            rounds = [p for p in run.phases if p.name == name]
            mode = pooled(name, rounds)
            per = 1000 / mode.requests
            median = statistics.median(p.appliance_s * 1000 / p.requests for p in rounds)
            print(f"| {run.label} | {name} | {mode.appliance_s * per:.2f} | {median:.2f} | "
                  f"{(mode.appliance_s + mode.api_server_s) * per:.2f} | "
                  f"{_ratio(mode.appliance_s, mode.api_server_s)} | "
                  f"{_ratio(mode.appliance_s, first.appliance_s)}x | "
                  f"{mode.off_loop_s * 1000 / mode.wall_s:.2f} |")
    for run in runs:
        idle = sum(i.off_loop_per_s for i in run.idles) / len(run.idles)
        print(f"| {run.label} | idle | | | | | | {idle * 1000:.2f} |")


if __name__ == "__main__":
    sys.exit(main())

