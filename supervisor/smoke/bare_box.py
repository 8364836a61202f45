"""Logging for the GPU smoke check on a bare GPU box: torch, nvidia-ml-py and psutil, and none
of the appliance's other dependencies (no network to install them, and the check must run
before anything is installed).

The modules the check runs (the NVML monitor, the release wait, the template's client) log
through structlog. Where structlog is installed, its events go to stderr (through the
appliance's own configuration where pydantic and msgspec are there too). Where it is not, a
small logger with structlog's calling convention takes its place: each event one line on
stderr, `event key=value ...`. Only the smoke check installs it; the appliance itself requires
structlog.
"""

from __future__ import annotations

import importlib.util
import sys
import time
import types
from typing import Any, TextIO


class _LineLogger:
    """`log.info("event", key=value)` as one line: time, level, event, its fields."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def _line(self, level: str, event: str, **fields: Any) -> None:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        pairs = " ".join(f"{key}={value!r}" for key, value in fields.items())
        print(f"{stamp} [{level}] {event} {pairs}".rstrip(), file=self._stream, flush=True)

    def debug(self, event: str, **fields: Any) -> None:
        self._line("debug", event, **fields)

    def info(self, event: str, **fields: Any) -> None:
        self._line("info", event, **fields)

    def warning(self, event: str, **fields: Any) -> None:
        self._line("warning", event, **fields)

    def error(self, event: str, **fields: Any) -> None:
        self._line("error", event, **fields)

    def exception(self, event: str, **fields: Any) -> None:
        self._line("error", event, **fields)


def _available(*modules: str) -> bool:
    try:
        return all(importlib.util.find_spec(name) is not None for name in modules)
    except ModuleNotFoundError:  # an import hook that refuses the name says so by raising
        return False


def log_to_stderr(stream: TextIO | None = None) -> None:
    """Make structlog's events reach `stream` (stderr), with or without structlog installed."""
    stream = stream or sys.stderr
    if not _available("structlog"):
        stand_in = types.ModuleType("structlog", "stands in for structlog on a bare GPU box")
        stand_in.get_logger = lambda name=None: _LineLogger(stream)  # type: ignore[attr-defined]
        sys.modules["structlog"] = stand_in
        return
    if _available("pydantic_settings", "msgspec"):
        from appliance.core.sections import LoggingSettings
        from supervisor.observe.logs import configure

        configure(LoggingSettings(format="console"), stream)
        return
    import structlog

    structlog.configure(logger_factory=structlog.PrintLoggerFactory(stream))
