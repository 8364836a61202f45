"""`chat-appliance crashes`: list the crash bundles, or show one (the newest by default)."""

from __future__ import annotations

import json
import time
from typing import Any, TextIO

from appliance.core.sections import CrashSettings
from supervisor.forensics.bundles import Bundles

EXIT_NONE = 1  # no such bundle


def crashes(settings: CrashSettings, show: str | None, as_json: bool, out: TextIO) -> int:
    """Lists the bundles, oldest first; with `show` ("last" or a name) prints that one."""
    bundles = Bundles(settings)
    names = bundles.names()
    if show is None:
        if not names:
            print(f"no crash bundles in {bundles.dir}", file=out)
        for name in names:
            print(_line(name, bundles.read(name)), file=out)
        return 0
    name = names[-1] if show == "last" and names else show
    try:
        bundle = bundles.read(name)
    except (FileNotFoundError, ValueError):
        print(f"no crash bundle {show!r} in {bundles.dir}", file=out)
        return EXIT_NONE
    print(json.dumps(bundle, indent=1) if as_json else describe(name, bundle), file=out)
    return 0


def _line(name: str, bundle: dict[str, Any]) -> str:
    cause = bundle.get("cause") or {}
    total = (cause.get("restart") or {}).get("total_s")
    back = f"back in {total}s" if total is not None else "not back"
    return (f"{name}  {cause.get('reason')}: {cause.get('detail')}  "
            f"({len(bundle.get('in_flight') or [])} in flight, {back})")


def describe(name: str, bundle: dict[str, Any]) -> str:
    """A bundle for people: the cause and timings first, then what was in flight, then the rest."""
    cause = bundle.get("cause") or {}
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(cause.get("at") or 0)))
    lines = [f"bundle:    {name}", f"at:        {at}", f"worker:    pid {bundle.get('pid')}",
             f"cause:     {cause.get('phase')} {cause.get('reason')}: {cause.get('detail')}",
             f"stopped:   in {bundle.get('stopped_in_s')}s",
             f"restart:   {cause.get('restart') or 'not completed'}",
             f"metrics:   {bundle.get('engine_metrics')}", f"gpu:       {bundle.get('gpu')}"]
    if bundle.get("trimmed"):
        lines.append(f"trimmed:   {', '.join(bundle['trimmed'])} (crashes.max_bytes)")
    requests = bundle.get("in_flight") or []
    lines.append(f"in flight: {len(requests)}")
    lines += [f"  {r.get('fingerprint')} {r.get('route')} client={r.get('client')} "
              f"{r.get('body_bytes')} bytes stream={r.get('stream')} id={r.get('request_id')}"
              for r in requests]
    for pid, text in (bundle.get("stacks") or {}).items():
        lines += [f"--- stacks of {pid}", text]
    lines.append("--- worker's last output lines")
    lines += bundle.get("log_tail") or []
    return "\n".join(lines)
