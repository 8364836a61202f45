"""A bounded hostile run against an appliance, with its memory and descriptors watched by pid.

Run: python -m load.hostile.run --url http://127.0.0.1:8000 --pid <serve's pid> [--scale 1]

Each attack of load.hostile.attacks runs in turn while an honest client polls /livez and sends a small
chat request every half second. The attacker then keeps every connection it opened for
--settle seconds (default 35: past the appliance's longest phase timeout, body_timeout_s 30),
and the appliance's RSS and open descriptors are read: by then the appliance must have shed
what it was sent (timeouts, caps, limits) on its own. A table says, per attack,
what came back, what the honest client saw, and RSS/fds before -> peak -> after.

The steady state is bounded: after each attack (connections still held by the attacker) RSS may
exceed its value before the run by --rss-growth-mib (default 128 MiB: room for what the
allocator keeps after parsing four legitimate 15.5 MiB bodies) and descriptors by
--fd-slack (default 16). The exit status is 1 if any attack leaves more, else 0.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import httpx

from load.hostile.attacks import ATTACKS, Attack, Outcome, Plan, release
from load.hostile.honest import Latencies, poll_livez_during
from load.kit import results
from load.kit.procstat import MIB, PeakSampler, Usage, usage
from load.kit.rawclient import Target

HONEST_CHAT = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4}
HONEST_PERIOD_S = 0.5


@dataclass(frozen=True)
class Bounds:
    rss_growth_mib: float
    fd_slack: int

    def holds(self, baseline: Usage, after: Usage) -> bool:
        return (after.rss_bytes - baseline.rss_bytes <= self.rss_growth_mib * MIB
                and after.fds <= baseline.fds + self.fd_slack)


@dataclass
class Row:
    attack: str
    answers: Counter[str]
    livez: Latencies
    chats: Counter[str]
    before: Usage
    peak: Usage
    after: Usage
    ok: bool


def honest_chats(url: str, headers: dict[str, str], stop: threading.Event) -> Counter[str]:
    """A small chat request every HONEST_PERIOD_S until `stop`: the statuses it got."""
    seen: Counter[str] = Counter()
    with httpx.Client(base_url=url, headers=headers, timeout=30, trust_env=False) as client:
        while not stop.is_set():
            try:
                seen[str(client.post("/v1/chat/completions", json=HONEST_CHAT).status_code)] += 1
            except httpx.HTTPError as exc:
                seen[type(exc).__name__] += 1
            stop.wait(HONEST_PERIOD_S)
    return seen


def run_attack(name: str, attack: Attack, plan: Plan, url: str, pid: int, settle_s: float,
               baseline: Usage, bounds: Bounds) -> Row:
    before = usage(pid)
    outcomes: list[Outcome] = []
    stop = threading.Event()
    chats: list[Counter[str]] = []
    chatter = threading.Thread(target=lambda: chats.append(
        honest_chats(url, dict(plan.headers), stop)), daemon=True)
    with PeakSampler(pid) as sampler:
        chatter.start()
        livez = poll_livez_during(url, [lambda: outcomes.append(attack(plan))])
        stop.set()
        chatter.join(60)
        time.sleep(settle_s)  # the attacker still holds all it opened: this is the steady state
    after = usage(pid)
    outcome = outcomes[0] if outcomes else Outcome(Counter({"attack failed": 1}))
    release(outcome)
    return Row(name, outcome.answers, livez, chats[0] if chats else Counter(), before,
               sampler.peak, after, bounds.holds(baseline, after))


def table(rows: Sequence[Row], baseline: Usage, bounds: Bounds) -> str:
    lines = [f"baseline {baseline}; bound after each attack: RSS +{bounds.rss_growth_mib:.0f} MiB,"
             f" fds +{bounds.fd_slack}",
             f"{'attack':<15} {'answers':<34} {'honest /livez':<34} {'honest chat':<16} "
             f"{'RSS MiB before>peak>after':<27} {'fds before>peak>after':<22} verdict"]
    for row in rows:
        rss = (f"{row.before.rss_mib:.0f}>{row.peak.rss_mib:.0f}>{row.after.rss_mib:.0f}")
        fds = f"{row.before.fds}>{row.peak.fds}>{row.after.fds}"
        lines.append(f"{row.attack:<15} {_counts(row.answers):<34} {row.livez!s:<34} "
                     f"{_counts(row.chats):<16} {rss:<27} {fds:<22} "
                     f"{'ok' if row.ok else 'OVER BOUND'}")
    return "\n".join(lines)


def _counts(counter: Counter[str]) -> str:
    return " ".join(f"{key}:{count}" for key, count in counter.most_common()) or "-"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the appliance, e.g. http://127.0.0.1:8000")
    parser.add_argument("--pid", type=int, required=True, help="pid of chat-appliance serve")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink counts and sizes")
    parser.add_argument("--hold", type=float, default=10.0, help="seconds slow/idle attackers wait")
    parser.add_argument("--settle", type=float, default=35.0,
                        help="seconds after each attack before the steady state is read; longer "
                        "than the appliance's longest phase timeout (server.body_timeout_s, 30)")
    parser.add_argument("--rss-growth-mib", type=float, default=128.0)
    parser.add_argument("--fd-slack", type=int, default=16)
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--only", action="append", choices=sorted(ATTACKS), default=None)
    results.add_option(parser)
    args = parser.parse_args(argv)
    with results.Printed() as printed:
        code = _measure(args)  # 1, over a bound, is a result too
    results.save(__spec__.name, argv, printed.text(), args.results)
    return code


def _measure(args: argparse.Namespace) -> int:
    headers = (("Authorization", f"Bearer {args.api_key}"),) if args.api_key else ()
    plan = Plan(Target.parse(args.url), args.scale, args.hold, headers)
    bounds = Bounds(args.rss_growth_mib, args.fd_slack)
    baseline = usage(args.pid)
    rows = [run_attack(name, attack, plan, args.url, args.pid, args.settle, baseline, bounds)
            for name, attack in ATTACKS.items() if not args.only or name in args.only]
    print(table(rows, baseline, bounds), flush=True)
    failed = [row.attack for row in rows if not row.ok]
    if failed:
        print(f"steady state over the bound after: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
