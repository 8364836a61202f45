"""structlog set-up: JSON lines in production, key-value on a terminal, secrets masked."""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import structlog

from appliance.settings import LoggingSettings

_SECRET_KEYS = ("authorization", "api_key", "api_keys", "password", "token", "secret")


def _mask_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in list(event):
        if any(word in key.lower() for word in _SECRET_KEYS):
            event[key] = "***"
    return event


def configure(settings: LoggingSettings, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    as_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())
    renderer: Any = (structlog.processors.JSONRenderer() if as_json
                     else structlog.dev.ConsoleRenderer(colors=stream.isatty()))
    level = getattr(logging, settings.level.upper())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _mask_secrets,
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(stream),
        cache_logger_on_first_use=True,
    )
    # Third-party stdlib loggers (uvicorn, httpx) go through the same stream at warning+.
    logging.basicConfig(stream=stream, level=max(level, logging.WARNING), force=True)
    for chatty in ("httpx", "httpcore", "uvicorn.error"):
        logging.getLogger(chatty).setLevel(max(level, logging.WARNING))
