"""Two runs of the same selection, directly and through the appliance: counts and differences."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.compat.selection import ALLOWED_DIFFERENCES, bare

OUTCOMES = ("passed", "failed", "skipped")


@dataclass(frozen=True)
class RunResult:
    """One run of the selection against one endpoint, as the plugin reported it."""

    label: str
    endpoint: str
    seconds: float
    outcomes: dict[str, str] = field(default_factory=dict)
    messages: dict[str, str] = field(default_factory=dict)
    served_model: str = ""
    exit_code: int = 0
    unused_exclusions: tuple[str, ...] = ()  # excluded ids this run did not collect: stale?

    @classmethod
    def from_report(cls, label: str, endpoint: str, seconds: float, path: Path,
                    exit_code: int) -> RunResult:
        if not path.is_file():  # pytest died before the session finished
            return cls(label, endpoint, seconds, exit_code=exit_code)
        data = json.loads(path.read_text())
        tests: dict[str, dict[str, str]] = data["tests"]
        return cls(label, endpoint, seconds,
                   outcomes={nodeid: entry["outcome"] for nodeid, entry in tests.items()},
                   messages={nodeid: entry["message"] for nodeid, entry in tests.items()
                             if "message" in entry},
                   served_model=str(data.get("served_model", "")), exit_code=exit_code,
                   unused_exclusions=tuple(data.get("unused_exclusions", ())))

    def counts(self) -> dict[str, int]:
        tally = Counter(self.outcomes.values())
        return {outcome: tally[outcome] for outcome in OUTCOMES}

    def summary(self) -> str:
        counts = self.counts()
        return (f"{self.label:<10} {counts['passed']:>3} passed {counts['failed']:>3} failed "
                f"{counts['skipped']:>3} skipped  ({self.seconds:.0f} s, {self.endpoint})")


@dataclass(frozen=True)
class Difference:
    nodeid: str
    direct: str
    appliance: str
    message: str
    allowed: str | None  # the reason, when this is a deliberate difference


def differences(direct: RunResult, appliance: RunResult) -> list[Difference]:
    """Every test whose outcome differs between the runs, each told allowed or not.

    A run that reported nothing (pytest died or was stopped) is not compared test by test.
    """
    found: list[Difference] = []
    if not (direct.outcomes and appliance.outcomes):
        return found
    for nodeid in sorted(direct.outcomes.keys() | appliance.outcomes.keys()):
        before, after = direct.outcomes.get(nodeid, "missing"), appliance.outcomes.get(nodeid, "missing")
        if before == after:
            continue
        message = appliance.messages.get(nodeid) or direct.messages.get(nodeid, "")
        reason = allowed_reason(nodeid, before, after, message)
        found.append(Difference(nodeid, before, after, message, reason))
    return found


def allowed_reason(nodeid: str, direct: str, appliance: str, message: str) -> str | None:
    """The reason a difference is deliberate: a listed test, refused for the listed cause."""
    rule = ALLOWED_DIFFERENCES.get(nodeid) or ALLOWED_DIFFERENCES.get(bare(nodeid))
    if rule is None or (direct, appliance) != ("passed", "failed"):
        return None
    marker, reason = rule
    return reason if marker in message else None


@dataclass(frozen=True)
class Verdict:
    direct: RunResult
    appliance: RunResult
    found: list[Difference]

    @property
    def unexpected(self) -> list[Difference]:
        return [d for d in self.found if d.allowed is None]

    @property
    def direct_failures(self) -> list[str]:
        return sorted(n for n, outcome in self.direct.outcomes.items() if outcome == "failed")

    @property
    def ok(self) -> bool:
        """Only deliberate differences, the selection holds on the worker, both runs complete."""
        complete = all(run.outcomes for run in (self.direct, self.appliance))
        return complete and not self.unexpected and not self.direct_failures

    def render(self) -> str:
        lines = [f"vLLM tests, served model {self.direct.served_model or '?'}:",
                 f"  {self.direct.summary()}", f"  {self.appliance.summary()}"]
        for label, group in (("allowed", [d for d in self.found if d.allowed]),
                             ("UNEXPECTED", self.unexpected)):
            if group:
                lines.append(f"{label} differences ({len(group)}):")
                lines += [f"  {d.nodeid}: {d.direct} -> {d.appliance}: {d.allowed or d.message}"
                          for d in group]
        if self.direct_failures:
            lines.append(f"failing against the worker itself ({len(self.direct_failures)}):")
            lines += [f"  {n}: {self.direct.messages.get(n, '')}" for n in self.direct_failures]
        if self.direct.unused_exclusions:
            lines.append("excluded but not collected (stale ids, or narrowed with -k):")
            lines += [f"  {nodeid}" for nodeid in self.direct.unused_exclusions]
        for run in (self.direct, self.appliance):
            if not run.outcomes:
                lines.append(f"the {run.label} run reported nothing (pytest exit {run.exit_code})")
        lines.append("verdict: " + ("only deliberate differences" if self.ok else "FAILED"))
        return "\n".join(lines)

    def as_json(self) -> dict[str, object]:
        return {
            "ok": self.ok,
            "served_model": self.direct.served_model,
            "runs": {run.label: {"endpoint": run.endpoint, "seconds": round(run.seconds, 1),
                                 "counts": run.counts(), "exit_code": run.exit_code}
                     for run in (self.direct, self.appliance)},
            "differences": [d.__dict__ for d in self.found],
            "direct_failures": self.direct_failures,
        }
