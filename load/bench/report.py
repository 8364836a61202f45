"""The gateway bench's tables: throughput ratios and added latency against direct, per mode."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

from load.bench.client import Sample
from load.locust.outcome import percentile

Key = tuple[str, bool, int]  # target, streaming, clients
Getter = Callable[[str], "Entry"]
TARGET_RATIO = 0.9
TARGET_ADDED_MS = 2.0


@dataclass
class Entry:
    """One target and mode, all rounds merged; per-round rates kept for their spread."""

    sample: Sample = field(default_factory=Sample)
    rounds: list[tuple[float, float]] = field(default_factory=list)  # requests/s, tokens/s
    cpu_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))

    def rps(self) -> float:
        return self.sample.requests / self.sample.elapsed_s if self.sample.elapsed_s else 0.0

    def tps(self) -> float:
        return self.sample.tokens / self.sample.elapsed_s if self.sample.elapsed_s else 0.0

    def ms(self, series: str, q: float) -> float | None:
        value = percentile(list(getattr(self.sample, series)), q)
        return None if value is None else value * 1000

    def cpu_ms_per_request(self, name: str) -> float | None:
        if name not in self.cpu_s or not self.sample.requests:
            return None
        return self.cpu_s[name] * 1000 / self.sample.requests


class Report:
    def __init__(self, clients: int, tokens: int, token_delay_s: float, rounds: int,
                 round_s: float, targets: list[str], notes: list[str], cores: int) -> None:
        self.clients, self.tokens, self.rounds, self.round_s = clients, tokens, rounds, round_s
        self.pace = f"{token_delay_s * 1000:g} ms per token" if token_delay_s else "no delay"
        self.targets, self.notes, self.cores = targets, notes, cores
        self.entries: dict[Key, Entry] = defaultdict(Entry)

    def add(self, target: str, stream: bool, clients: int, sample: Sample,
            cpu_s: dict[str, float]) -> None:
        entry = self.entries[(target, stream, clients)]
        entry.sample.merge(sample)
        elapsed = sample.elapsed_s or 1.0
        entry.rounds.append((sample.requests / elapsed, sample.tokens / elapsed))
        for name, seconds in cpu_s.items():
            entry.cpu_s[name] += seconds

    def render(self, wall_s: float) -> str:
        lines = self._preamble(wall_s)
        for stream in (True, False):
            lines += self._table(stream, self.clients)
        if any(key[2] == 1 for key in self.entries):
            lines += self._single()
        if {"appliance", "baseline"} <= set(self.targets):
            lines += self._versus("appliance", "baseline")
        lines += self._verdict()
        return "\n".join(lines)

    def _preamble(self, wall_s: float) -> list[str]:
        return [
            "== gateway bench: what the appliance itself costs ==",
            f"synthetic upstream: {self.tokens} tokens per answer, {self.pace}; {self.clients} "
            f"closed-loop clients; {self.rounds} rounds x {self.round_s:g} s per target and mode, "
            "target order rotated each round; whole run "
            f"{wall_s:.0f} s",
            f"NOTE: the load generator, the upstream and the proxy under test share this "
            f"machine's {self.cores} CPU cores (the generator's own CPU is shown per request): "
            "read the ratios, not the absolute numbers.",
            *self.notes,
        ]

    def _row(self, label: str, cell: Callable[[str], str]) -> str:
        return f"{label:<30}" + "".join(f"{cell(t):>24}" for t in self.targets)

    def _table(self, stream: bool, clients: int) -> list[str]:
        base = self.entries.get(("direct", stream, clients))
        if base is None:
            return []

        def get(target: str) -> Entry:
            return self.entries[(target, stream, clients)]

        lines = ["", f"-- {'streaming' if stream else 'non-streaming'}, {clients} clients --",
                 self._row("", str),
                 self._row("requests/s", lambda t: _rate(get(t).rps(), base.rps())),
                 self._row("  per-round ratio (min-max)", lambda t: _spread(get(t), base, 0))]
        if stream:
            lines += [self._row("streamed tokens/s", lambda t: _rate(get(t).tps(), base.tps())),
                      self._row("  per-round ratio (min-max)", lambda t: _spread(get(t), base, 1))]
        series = [("request", "latency_s")]
        if stream:
            series += [("TTFT", "ttft_s"), ("inter-token (TPOT)", "tpot_s")]
        for label, name in series:
            lines.append(self._row(f"{label} p50 / p99 ms", partial(_pair, get, name)))
        for label, name in series:
            lines.append(self._row(f"added {label} p50 / p99 ms",
                                   partial(_added, get, base, name)))
        lines.append(self._row("errors", lambda t: _errors(get(t))))
        for proc in ("proxy", "upstream", "generator"):
            lines.append(self._row(f"CPU ms per request: {proc}", partial(_cpu, get, proc)))
        return lines

    def _single(self) -> list[str]:
        lines = ["", "-- one client (unloaded): the hop itself --", self._row("", str)]
        for stream, label, name in ((False, "added request p50 ms", "latency_s"),
                                    (True, "added TTFT p50 ms", "ttft_s"),
                                    (True, "added inter-token p50 ms", "tpot_s")):
            base = self.entries.get(("direct", stream, 1))
            if base is None:
                continue

            def get(target: str, stream: bool = stream) -> Entry:
                return self.entries[(target, stream, 1)]

            lines.append(self._row(label, partial(_delta, get, base, name, 50)))
        return lines

    def _versus(self, mine: str, theirs: str) -> list[str]:
        """This tree's appliance against the baseline's, from the same rounds: each figure as
        `mine / theirs` and their ratio (below 1 for time and CPU, above 1 for rates: better)."""
        lines = ["", f"-- {mine} (this tree) against {theirs}: mine / theirs (ratio) --"]
        for stream in (True, False):
            a = self.entries.get((mine, stream, self.clients))
            b = self.entries.get((theirs, stream, self.clients))
            if a is None or b is None:
                continue
            mode = f"{'streaming' if stream else 'non-streaming'}, {self.clients} clients"
            lines.append(f"{mode}: requests/s {_versus(a.rps(), b.rps(), 1)}"
                         + (f"; tokens/s {_versus(a.tps(), b.tps(), 1)}" if stream else "")
                         + f"; proxy CPU ms per request "
                         f"{_versus(a.cpu_ms_per_request(mine), b.cpu_ms_per_request(theirs), 3)}"
                         f"; request p50 ms {_versus(a.ms('latency_s', 50), b.ms('latency_s', 50))}")
        for stream, label, series in ((False, "request", "latency_s"), (True, "TTFT", "ttft_s")):
            a, b = self.entries.get((mine, stream, 1)), self.entries.get((theirs, stream, 1))
            if a is not None and b is not None:
                lines.append(f"one client, {label} p50 ms: "
                             f"{_versus(a.ms(series, 50), b.ms(series, 50), 3)}")
        return lines

    def _verdict(self) -> list[str]:
        key = ("appliance", True, self.clients)
        base = self.entries.get(("direct", True, self.clients))
        if key not in self.entries or base is None:
            return []
        mine = self.entries[key]
        ratio = min(mine.rps() / base.rps(), mine.tps() / base.tps()) if base.tps() else 0.0
        added = _diff(mine.ms("ttft_s", 50), base.ms("ttft_s", 50))
        lines = ["", f"verdict (appliance, {self.clients} streams):",
                 f"  throughput {ratio:.2f}x direct (target >= {TARGET_RATIO}x): "
                 f"{'met' if ratio >= TARGET_RATIO else 'MISSED'}",
                 f"  added TTFT p50 {_fmt(added)} ms (target < {TARGET_ADDED_MS:g} ms): "
                 f"{'met' if added is not None and added < TARGET_ADDED_MS else 'MISSED'}"]
        other = self.entries.get(("litellm", True, self.clients))
        if other is not None:
            theirs = _diff(other.ms("ttft_s", 50), base.ms("ttft_s", 50))
            below = (added is not None and theirs is not None and added < theirs
                     and mine.tps() > other.tps())
            lines.append(f"  below LiteLLM's overhead (added TTFT p50 {_fmt(theirs)} ms, "
                         f"{other.tps() / base.tps():.2f}x tokens/s): "
                         f"{'met' if below else 'MISSED'}")
        return lines


def _versus(mine: float | None, theirs: float | None, digits: int = 2) -> str:
    if mine is None or theirs is None:
        return "n/a"
    ratio = f" ({mine / theirs:.2f}x)" if theirs else ""
    return f"{mine:.{digits}f} / {theirs:.{digits}f}{ratio}"


def _fmt(value: float | None, sign: bool = True) -> str:
    if value is None:
        return "n/a"
    return f"{value:+.2f}" if sign else f"{value:.2f}"


def _diff(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a - b


def _rate(value: float, base: float) -> str:
    return f"{value:.1f} ({value / base:.2f}x)" if base else f"{value:.1f}"


def _spread(entry: Entry, base: Entry, index: int) -> str:
    ratios = [mine[index] / theirs[index] for mine, theirs in zip(entry.rounds, base.rounds, strict=False)
              if theirs[index]]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "n/a"


def _pair(get: Getter, series: str, target: str) -> str:
    entry = get(target)
    return f"{_fmt(entry.ms(series, 50), False)} / {_fmt(entry.ms(series, 99), False)}"


def _delta(get: Getter, base: Entry, series: str, q: float, target: str) -> str:
    return _fmt(_diff(get(target).ms(series, q), base.ms(series, q)))


def _added(get: Getter, base: Entry, series: str, target: str) -> str:
    return (f"{_delta(get, base, series, 50, target)} / "
            f"{_delta(get, base, series, 99, target)}")


def _errors(entry: Entry) -> str:
    if not entry.sample.errors:
        return "0"
    return ", ".join(f"{k}: {v}" for k, v in entry.sample.errors.most_common(2))


def _cpu(get: Getter, proc: str, target: str) -> str:
    # The proxy's CPU is recorded under the target's own name; direct has no proxy.
    value = get(target).cpu_ms_per_request(target if proc == "proxy" else proc)
    return "-" if value is None else f"{value:.2f}"
