"""One finding per check, and the report `chat-appliance doctor` prints (text or JSON)."""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


class Level(enum.Enum):
    OK = "ok"
    SKIP = "skip"  # does not apply to this box (no GPU: the CPU engine)
    WARNING = "warning"
    BLOCKER = "blocker"


@dataclass(frozen=True)
class Finding:
    """What one check found. `lasting`: a blocker a restart cannot cure (an old driver, a
    missing compiler), as opposed to one that may pass later (GPU memory another process holds);
    `serve` refuses to start only on lasting blockers."""

    check: str
    level: Level
    message: str
    fix: str = ""
    lasting: bool = True
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def refuses_start(self) -> bool:
        return self.level is Level.BLOCKER and self.lasting


def ok(check: str, message: str, **detail: Any) -> Finding:
    return Finding(check, Level.OK, message, detail=detail)


def skip(check: str, message: str) -> Finding:
    return Finding(check, Level.SKIP, message)


def warning(check: str, message: str, fix: str, **detail: Any) -> Finding:
    return Finding(check, Level.WARNING, message, fix, detail=detail)


def blocker(check: str, message: str, fix: str, *, lasting: bool = True, **detail: Any) -> Finding:
    return Finding(check, Level.BLOCKER, message, fix, lasting, detail)


def render_text(findings: Iterable[Finding]) -> str:
    """One line per check, the fix indented under anything that is not fine."""
    lines = []
    for finding in findings:
        lines.append(f"{finding.level.value:<8} {finding.check:<14} {finding.message}")
        if finding.fix:
            lines.append(f"{'':<8} {'':<14} fix: {finding.fix}")
    return "\n".join(lines)


def render_json(findings: Iterable[Finding]) -> str:
    return json.dumps([{"check": f.check, "level": f.level.value, "message": f.message,
                        "fix": f.fix, "lasting": f.lasting, "detail": f.detail}
                       for f in findings], indent=2)


def one_line(finding: Finding) -> str:
    """The reason `serve` gives when it refuses to start."""
    return f"{finding.check}: {finding.message}; fix: {finding.fix}"
