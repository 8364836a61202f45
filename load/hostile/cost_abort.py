"""The run-time cost abort on the real worker: another client's short request, alone and beside a
costly constrained request, with the abort on and off, side by side.

Run: python -m load.hostile.cost_abort [--ramp-s 0.3] [--rounds 3]

It boots the appliance twice on the real worker (constraints.abort_when_slow true, then false).
In each: the victim's short chat request (10 tokens, not streamed) is timed alone; then a
constrained stream whose grammar passes the gate's static vetting but grows costlier with each
token (an ambiguous grammar: its matcher's work per token grows as it goes) runs alone until its
own tokens come `--ramp-s` apart (five in a row), and the victim is sent beside it. Prints, per
setting, the victim's time alone and beside, their ratio (the bar: 3x), and how the costly
request ended.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from load.hostile.constraint_cost import VICTIM, timed_chat
from load.kit import results

# Within every static limit (no quantifier, shallow), yet ambiguous: each token the engine must
# weigh every way of splitting what came so far, for the whole vocabulary.
COSTLY_GRAMMAR = "root ::= s\ns ::= s s s | s s | [a-z ]"
# No end of its own: sampled text can meet the grammar's end before the engine grows slow.
# A fixed seed: the same sampled text every run. Not all text is costly here (greedy text is
# not, and some samples were not), so an unseeded run could pass or fail by chance.
COSTLY: dict[str, object] = {"messages": [{"role": "user", "content": "Write letters."}],
                             "max_tokens": 400, "stream": True, "ignore_eos": True, "seed": 1,
                             "structured_outputs": {"grammar": COSTLY_GRAMMAR}}
WARM_STREAM: dict[str, object] = VICTIM | {"stream": True}
_RAMP_TOKENS = 5


@dataclass
class Costly:
    """The costly stream as its client saw it."""

    gaps: list[float] = field(default_factory=list)  # seconds between its events
    error_code: str | None = None  # the code of an error event that ended it
    ramped: threading.Event = field(default_factory=threading.Event)
    stop: threading.Event = field(default_factory=threading.Event)


@dataclass(frozen=True)
class Outcome:
    alone_s: float
    beside_s: float
    beside_status: int
    costly: Costly

    @property
    def ratio(self) -> float:
        return self.beside_s / self.alone_s


def _run_costly(client: httpx.Client, body: Mapping[str, object], ramp_s: float,
                costly: Costly) -> None:
    """Reads the costly stream, says when its own tokens come `ramp_s` apart, and hangs up
    once told to (without the abort it would run for minutes)."""
    last: float | None = None
    with client.stream("POST", "/v1/chat/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                costly.gaps.append(now - last)
            last = now
            event = json.loads(line[6:])
            if "error" in event:
                costly.error_code = event["error"].get("code")
                break
            if len(costly.gaps) >= _RAMP_TOKENS and min(costly.gaps[-_RAMP_TOKENS:]) >= ramp_s:
                costly.ramped.set()  # slow for a while, not one gap a busy machine stretched
            if costly.stop.is_set():
                break
    costly.ramped.set()


def victim_beside_costly(url: str, *, ramp_s: float = 0.3, rounds: int = 3,
                         costly_body: Mapping[str, object] = COSTLY) -> Outcome:
    """The victim alone (median of `rounds`), then beside the costly stream once it is slow."""
    with httpx.Client(base_url=url, timeout=600) as client:
        with client.stream("POST", "/v1/chat/completions", json=WARM_STREAM) as warm:
            warm.read()  # the engine's norm, seen on a stream
        alone = statistics.median(timed_chat(client, None, VICTIM)[0] for _ in range(rounds))
        costly = Costly()
        reader = threading.Thread(target=_run_costly, args=(client, costly_body, ramp_s, costly))
        reader.start()
        costly.ramped.wait()
        beside, status = timed_chat(client, None, VICTIM)
        costly.stop.set()
        reader.join()
    return Outcome(alone, beside, status, costly)


def _describe(costly: Costly) -> str:
    slowest = max(costly.gaps, default=0.0)
    ended = (f"ended with {costly.error_code}" if costly.error_code
             else "ran on (hung up by this tool)")
    return f"{len(costly.gaps) + 1} tokens, slowest gap {slowest:.2f} s, {ended}"


def main(argv: Sequence[str] | None = None) -> int:
    from load.kit.appliance import running_appliance  # the real worker, booted as tested

    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ramp-s", type=float, default=0.3,
                        help="send the victim once the costly stream's tokens are this far apart")
    parser.add_argument("--rounds", type=int, default=3, help="victim runs alone (median)")
    results.add_option(parser)
    args = parser.parse_args(argv)
    rows = []
    for abort in ("true", "false"):
        with tempfile.TemporaryDirectory(prefix="cost-abort-") as workdir, \
                running_appliance(Path(workdir), constraints__abort_when_slow=abort) as appliance:
            appliance.wait_ready()
            outcome = victim_beside_costly(appliance.url, ramp_s=args.ramp_s, rounds=args.rounds)
        rows.append((abort, outcome))
    with results.Printed() as printed:
        print(f"{'abort_when_slow':<16} {'victim alone':>13} {'beside costly':>14} {'ratio':>6}  "
              "costly request")
        for abort, o in rows:
            print(f"{abort:<16} {o.alone_s:>11.2f} s {o.beside_s:>12.2f} s {o.ratio:>5.1f}x  "
                  f"{_describe(o.costly)} (victim status {o.beside_status})")
    results.save(__spec__.name, argv, printed.text(), args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
