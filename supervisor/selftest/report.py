"""The self-test's report: each check's verdict and what it measured; JSON and a summary."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import psutil

Measured = dict[str, float | int | str | bool | None]


class CheckFailed(Exception):
    """A check saw the box misbehave; the message says what it saw."""


@dataclass
class Check:
    name: str
    ok: bool | None  # None: not applicable on this box (skipped), never a failure
    detail: str
    measured: Measured = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def verdict(self) -> str:
        return {True: "pass", False: "FAIL", None: "skip"}[self.ok]


# What a check may raise that means "the box failed it", not "the self-test is broken".
_SEEN = (CheckFailed, httpx.HTTPError, psutil.Error, OSError, ValueError, KeyError, TypeError)


def timed(name: str, check: Callable[[], Check]) -> Check:
    """Run one check; a failure it raises is its verdict, with the time it took."""
    started = time.monotonic()
    try:
        result = check()
    except _SEEN as exc:
        result = Check(name, False, f"{type(exc).__name__}: {exc}")
    result.seconds = round(time.monotonic() - started, 2)
    return result


@dataclass
class Report:
    mode: str  # "temporary": an instance of its own; "running": the service, with consent
    url: str
    disturbs: list[str]
    checks: list[Check] = field(default_factory=list)
    started: float = field(default_factory=time.time)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(check.ok is not False for check in self.checks)

    def exit_status(self) -> int:
        return 0 if self.ok else 1

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "mode": self.mode, "url": self.url, "disturbs": self.disturbs,
                "started": round(self.started, 1), "seconds": round(self.seconds, 1),
                "checks": [asdict(check) | {"verdict": check.verdict} for check in self.checks]}

    def to_json(self) -> str:
        return json.dumps(self.as_dict(), indent=2)

    def summary(self) -> str:
        """For a person: one line a check, the failures' reasons, the verdict last."""
        width = max((len(check.name) for check in self.checks), default=10)
        lines = [f"chat-appliance selftest ({self.mode}, {self.url})"]
        for check in self.checks:
            lines.append(f"  {check.verdict:<4}  {check.name:<{width}}  {check.detail}")
        failed = [check.name for check in self.checks if check.ok is False]
        verdict = "PASS" if self.ok else f"FAIL ({', '.join(failed) or 'nothing checked'})"
        lines.append(f"{verdict} in {self.seconds:.0f} s")
        return "\n".join(lines)
