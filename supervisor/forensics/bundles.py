"""Crash bundles on disk: one JSON file per engine death, bounded in size and count.

A bundle is written once at the death (atomically, mode 0600: supervisor.operator.private) and
rewritten once when the restart that followed completes, to add its timings. Past
`crashes.keep` bundles the oldest are deleted; past `crashes.max_bytes` a bundle's log lines,
stacks and request list are trimmed, oldest lines first, and the bundle says what was cut.
"""

from __future__ import annotations

import json
import time
from typing import Any

import structlog

from appliance.core.sections import CrashSettings
from supervisor.operator.private import write_private

log = structlog.get_logger("supervisor.forensics.bundles")

SUFFIX = ".json"


class Bundles:
    """The bundles directory: write, rotate, list and read."""

    def __init__(self, settings: CrashSettings) -> None:
        self._settings = settings
        self.dir = settings.resolved_dir()

    def write(self, bundle: dict[str, Any], name: str | None = None) -> str | None:
        """Writes `bundle` (under a new name unless `name`), drops the oldest past `keep`;
        the bundle's name, or None if the directory cannot be written (logged)."""
        name = name or _name(bundle)
        data = _fit(bundle, self._settings.max_bytes)
        try:
            # It names clients and holds the worker's log lines: 0600 in whatever directory.
            write_private(self.dir / (name + SUFFIX), data)
        except OSError as error:
            log.warning("crash.bundle_unwritable", dir=str(self.dir),
                        error=error.strerror or str(error))
            return None
        self._rotate()
        return name

    def names(self) -> list[str]:
        """Bundle names, oldest first."""
        try:
            return sorted(p.name.removesuffix(SUFFIX) for p in self.dir.glob("*" + SUFFIX))
        except OSError:
            return []

    def read(self, name: str) -> dict[str, Any]:
        """One bundle by name; FileNotFoundError for a name that is not one of names()."""
        if name not in self.names():
            raise FileNotFoundError(name)
        loaded: dict[str, Any] = json.loads((self.dir / (name + SUFFIX)).read_text())
        return loaded

    def _rotate(self) -> None:
        names = self.names()
        for old in names[:max(0, len(names) - self._settings.keep)]:
            try:
                (self.dir / (old + SUFFIX)).unlink()
            except OSError as error:
                log.warning("crash.bundle_undeletable", name=old, error=error.strerror)


def _name(bundle: dict[str, Any]) -> str:
    """Sorts by time of death: UTC stamp, worker pid, reason."""
    cause = bundle.get("cause") or {}
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(float(cause.get("at") or time.time())))
    return f"{stamp}-{bundle.get('pid') or 0}-{cause.get('reason') or 'unknown'}"


def _fit(bundle: dict[str, Any], limit: int) -> bytes:
    """The bundle as JSON within `limit` bytes: the oldest log lines, then the stacks' ends,
    then the request list are cut until it fits."""
    bundle = dict(bundle)
    cuts: list[str] = []
    while True:
        data = json.dumps(bundle, indent=1, default=str).encode()
        excess = len(data) - limit
        if excess <= 0:
            return data
        lines = bundle.get("log_tail") or []
        stacks = bundle.get("stacks") or {}
        requests = bundle.get("in_flight") or []
        if lines:
            keep = max(0, len(lines) - max(1, len(lines) // 4))
            bundle["log_tail"] = lines[len(lines) - keep:]
            cuts.append("log_tail")
        elif any(stacks.values()):
            bundle["stacks"] = {pid: text[:len(text) // 2] for pid, text in stacks.items()}
            cuts.append("stacks")
        elif requests:
            bundle["in_flight"] = requests[:len(requests) // 2]
            cuts.append("in_flight")
        else:
            bundle = {key: bundle.get(key) for key in ("cause", "pid")}
            cuts.append("everything else")
        bundle["trimmed"] = sorted(set(cuts))
        if cuts[-1] == "everything else":
            return json.dumps(bundle, default=str).encode()
