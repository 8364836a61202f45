"""The appliance's own work per request, counted in instructions: side by side, the same each run.

    python -m load.bench.instructions [--baseline CHECKOUT] [--compare-resume]
                                      [--requests 160] [--concurrency 4] [--tokens 32]
                                      [--token-delay 0.02]

CPU time on the shared 2-core test box moves 7-10 % between runs of the same code
(load.bench.cpu, load.bench.gateway), more than most changes cost, so a change's cost there is
seldom told from the noise. Here each appliance runs under valgrind's callgrind, which counts
the instructions its process executes in user space; run to run they agree within about 1 %.
What it leaves out: the kernel's share (the socket calls, about a third of the appliance's CPU
time) and what an instruction costs (cache misses, a busy box); load.bench.gateway and
load.bench.cpu measure time.

Each appliance in turn serves over its own synthetic upstream (run natively, paced by
--token-delay so that each event comes in a read of its own, as vLLM's do), with a key and no
other setting. Instructions are counted only once it serves and a warm-up has run. For each mode
(streamed, then not) it reads the count of a short load and of a long one; their difference, less
the idle rate (monitoring, probes: measured over a quiet window) for the time between, divided
by the extra requests, is the count per request. The first target is this checkout; with
--baseline another checkout's appliance (`git worktree add /tmp/base <commit>`); with
--compare-resume this checkout with `resume.enabled = false`. Ratios are to the last target.

Needs valgrind (Debian: `apt-get install valgrind`).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from load.bench.cpu import drive
from load.bench.stack import ROOT, Service, start_appliance, wait_http
from load.kit import results
from load.kit.net import free_port

API_KEY = "sk-bench-0123456789abcdef"
HEADERS = {"authorization": f"Bearer {API_KEY}"}
IDLE_S = 10.0
_TOTAL = re.compile(rb"^(?:summary|totals):\s+(\d+)", re.M)


@dataclass(frozen=True)
class Target:
    name: str
    root: Path
    settings: dict[str, str]


@dataclass(frozen=True)
class Count:
    """One mode's instructions per request, and the reading it came from."""

    per_request: float
    idle_per_s: float
    short: tuple[int, float, int]  # requests, seconds, instructions
    long: tuple[int, float, int]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=160, help="the long load's requests "
                        "(the short one's: a quarter)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--token-delay", type=float, default=0.02,
                        help="upstream seconds per token (each event a read of its own)")
    parser.add_argument("--baseline", type=Path, metavar="CHECKOUT")
    parser.add_argument("--compare-resume", action="store_true")
    results.add_option(parser)
    return parser.parse_args(argv)


def targets(args: argparse.Namespace) -> list[Target]:
    found = [Target(f"this tree ({ROOT.name})", ROOT, {})]
    if args.compare_resume:
        found.append(Target("this tree, resume off", ROOT,
                            {"CHAT_APPLIANCE_RESUME__ENABLED": "false"}))
    if args.baseline is not None:
        base = args.baseline.resolve()
        found.append(Target(f"baseline ({_commit(base)})", base, {}))
    return found


class Callgrind:
    """An appliance under callgrind, instrumented on demand, its counts read by dumps."""

    def __init__(self, service: Service, out: Path) -> None:
        self.service = service
        self._out = out

    def _control(self, *options: str) -> None:
        subprocess.run(["callgrind_control", *options, str(self.service.proc.pid)],
                       capture_output=True, check=True, timeout=120)

    def instrument(self) -> None:
        self._control("-i", "on")

    def count(self) -> int:
        """Instructions since the last count (a dump resets the counters)."""
        before = set(self._out.parent.glob(f"{self._out.name}.*"))
        self._control("-d")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            new = set(self._out.parent.glob(f"{self._out.name}.*")) - before
            for path in new:
                if (match := _TOTAL.search(path.read_bytes())) is not None:
                    return int(match.group(1))
            time.sleep(0.2)
        raise SystemExit(f"callgrind wrote no count for {self.service.name}")


def measure(target: Target, args: argparse.Namespace, workdir: Path) -> dict[str, Count]:
    port, upstream_port = free_port(), free_port()
    out = workdir / f"callgrind-{port}.out"
    service = start_appliance(port, upstream_port, args.tokens, args.token_delay, API_KEY,
                              workdir, None, f"appliance-{port}", target.settings,
                              root=target.root,
                              under=["valgrind", "--tool=callgrind", "--instr-atstart=no",
                                     f"--callgrind-out-file={out}.%p"])
    url = f"http://127.0.0.1:{port}"
    try:
        if not wait_http(service, f"{url}/health", 600):
            raise SystemExit(f"{target.name} never served:\n{service.tail()}")
        grind = Callgrind(service, out)
        for stream in (True, False):  # warm: every path of both modes has run once
            asyncio.run(drive(url, stream, 20, args.concurrency, args.tokens, HEADERS))
        grind.instrument()
        readings: dict[str, list[tuple[int, float, int]]] = {}
        for mode, stream in (("streaming", True), ("non-streaming", False)):
            for requests in (max(1, args.requests // 4), args.requests):
                grind.count()
                began = time.monotonic()
                asyncio.run(drive(url, stream, requests, args.concurrency, args.tokens, HEADERS))
                seconds = time.monotonic() - began
                readings.setdefault(mode, []).append((requests, seconds, grind.count()))
        grind.count()
        time.sleep(IDLE_S)
        idle = grind.count() / IDLE_S
    finally:
        service.stop()
    return {mode: _per_request(short, long, idle) for mode, (short, long) in readings.items()}


def _per_request(short: tuple[int, float, int], long: tuple[int, float, int],
                 idle: float) -> Count:
    (n1, s1, i1), (n2, s2, i2) = short, long
    return Count(((i2 - idle * s2) - (i1 - idle * s1)) / (n2 - n1), idle, short, long)


def report(results: list[tuple[Target, dict[str, Count]]], args: argparse.Namespace) -> None:
    last = results[-1][1]
    print(f"\ninstructions per request (millions), the appliance's process in user space; "
          f"{args.tokens} tokens, {args.concurrency} at a time, {args.token_delay:g} s a token")
    print(f"{'':44s}{'streaming':>22s}{'non-streaming':>22s}{'idle MIr/s':>12s}")
    for target, counts in results:
        cells = []
        for mode in ("streaming", "non-streaming"):
            millions = counts[mode].per_request / 1e6
            ratio = counts[mode].per_request / last[mode].per_request
            cells.append(f"{millions:.3f} ({ratio:.2f}x)")
        print(f"{target.name[:43]:44s}{cells[0]:>22s}{cells[1]:>22s}"
              f"{counts['streaming'].idle_per_s / 1e6:>12.2f}")
    for target, counts in results:
        for mode, count in counts.items():
            print(f"  {target.name[:40]}, {mode}: {count.short[0]} requests in "
                  f"{count.short[1]:.1f} s {count.short[2] / 1e6:.1f} MIr; {count.long[0]} in "
                  f"{count.long[1]:.1f} s {count.long[2] / 1e6:.1f} MIr")


def _commit(root: Path) -> str:
    try:
        return subprocess.run(["git", "-C", str(root), "log", "-1", "--format=%h"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return root.name


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return results.recorded(__spec__.name, argv, args.results, lambda: _measure(args))


def _measure(args: argparse.Namespace) -> int:
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-instructions-") as tmp:
        for target in targets(args):
            print(f"measuring {target.name} ...", flush=True)
            results.append((target, measure(target, args, Path(tmp))))
    report(results, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
