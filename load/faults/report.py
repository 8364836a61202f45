"""The fault-load run's accounting: each request tied to the faults it met, tallied per fault and
in total, and two configurations printed side by side.

A request met a fault when it was in flight at some moment between the signal and the new
worker's readiness (it began before the recovery and ended after the signal): that covers the
requests the fault interrupted and those sent while the engine was away. Seams are counted for
the requests that met no fault too: the reference texts come from a run without faults, and
that count is the comparison's own noise (a CPU engine's greedy output can depend on what else
is in the batch).
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass, field

from load.faults.chaos import Strike
from load.faults.seams import Result, failure, seams

References = dict[tuple[str, str], str]  # (route, prompt) -> an uninterrupted greedy answer


@dataclass
class Tally:
    """Requests, what failed and what showed a seam, and the timings of them all."""

    requests: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    seams: Counter[str] = field(default_factory=Counter)
    ttft_s: list[float] = field(default_factory=list)
    total_s: list[float] = field(default_factory=list)
    retried: int = 0  # requests that were asked again after a 503, as an SDK does

    def add(self, result: Result, references: References) -> None:
        self.requests += 1
        self.retried += result.retries > 0
        why = failure(result)
        if why is not None:
            self.failures[why] += 1
        self.seams.update(seams(result, references.get((result.route, result.prompt))))
        if result.ttft_s is not None:
            self.ttft_s.append(result.ttft_s)
        self.total_s.append(result.total_s)


@dataclass
class Run:
    """One configuration's run: its faults, the requests they met, and all the others."""

    name: str
    strikes: list[Strike]
    per_fault: list[Tally]
    met_none: Tally
    total: Tally


def met(result: Result, strike: Strike, end_s: float) -> bool:
    recovered = strike.recovered_s if strike.recovered_s is not None else end_s
    return result.started < recovered and result.ended > strike.at_s


def account(name: str, results: list[Result], strikes: list[Strike],
            references: References) -> Run:
    end_s = max((r.ended for r in results), default=0.0)
    run = Run(name, strikes, [Tally() for _ in strikes], Tally(), Tally())
    for result in results:
        run.total.add(result, references)
        hit = [k for k, strike in enumerate(strikes) if met(result, strike, end_s)]
        for k in hit:
            run.per_fault[k].add(result, references)
        if not hit:
            run.met_none.add(result, references)
    return run


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{n} {what}" for what, n in counter.most_common()) or "none"


def _times(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} / {max(values):.1f} s"


def _tally_rows(label: str, tally: Tally) -> list[tuple[str, str]]:
    failed = sum(tally.failures.values())
    return [(f"{label}: requests", str(tally.requests)),
            ("  client-visible failures", f"{failed}" + (f" ({_counts(tally.failures)})"
                                                         if failed else "")),
            ("  asked again after a 503 (as an SDK)", str(tally.retried)),
            ("  seams", _counts(tally.seams)),
            ("  TTFT median / max", _times(tally.ttft_s)),
            ("  total time median / max", _times(tally.total_s))]


def rows(run: Run) -> list[tuple[str, str]]:
    """The run as (label, value) rows, in the order they print."""
    found: list[tuple[str, str]] = []
    for k, (strike, tally) in enumerate(zip(run.strikes, run.per_fault, strict=True), 1):
        kind = "kill -9" if strike.action == "kill" else "SIGSTOP"
        back = ("not recovered" if strike.recovered_s is None
                else f"ready {strike.recovered_s - strike.at_s:.1f} s later")
        found.append((f"fault {k}", f"{kind} EngineCore at {strike.at_s:.0f} s, {back}"))
        found += _tally_rows("  met it", tally)
    found += _tally_rows("met no fault", run.met_none)
    found += _tally_rows("all", run.total)
    return found


def side_by_side(runs: list[Run]) -> str:
    """The runs' rows next to each other; a row one run lacks (fewer faults) is blank there."""
    tables = [_keyed(rows(run)) for run in runs]
    order: dict[tuple[str, str], str] = {}
    for table in sorted(tables, key=len, reverse=True):
        order.update((key, key[1]) for key in table if key not in order)
    widths = [max(len(run.name), *map(len, table.values())) + 3
              for run, table in zip(runs, tables, strict=True)]
    lines = [f"{'':<32}" + "".join(f"{run.name:<{w}}" for run, w in zip(runs, widths, strict=True))]
    for key, label in order.items():
        lines.append(f"{label:<32}" + "".join(f"{table.get(key, ''):<{w}}"
                                             for table, w in zip(tables, widths, strict=True)))
    return "\n".join(line.rstrip() for line in lines)


def _keyed(table: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """Rows keyed by their section and label: each fault's rows repeat the same labels."""
    keyed: dict[tuple[str, str], str] = {}
    section = ""
    for label, value in table:
        if not label.startswith(" "):
            section = label
        keyed[(section, label)] = value
    return keyed
