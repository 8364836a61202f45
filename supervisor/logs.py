"""structlog set-up: JSON lines in production, key-value on a terminal, secrets masked."""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import MutableMapping
from typing import Any, TextIO

import msgspec
import structlog

from appliance.settings import LoggingSettings

_SECRET_KEYS = ("authorization", "api_key", "api_keys", "password", "token", "secret")


@functools.cache
def _is_secret(key: str) -> bool:
    return any(word in key.lower() for word in _SECRET_KEYS)


def _mask_secrets(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
    for key in event:
        if _is_secret(key):
            event[key] = "***"
    return event


def _json_line(event: MutableMapping[str, Any], **_: Any) -> str:
    # msgspec: a third of json.dumps' cost on the per-request access line; anything it
    # cannot encode is shown as its repr, as structlog's own renderer does.
    return msgspec.json.encode(event, enc_hook=repr).decode()


def configure(settings: LoggingSettings, stream: TextIO | None = None) -> None:
    stream = stream or sys.stderr
    as_json = settings.format == "json" or (settings.format == "auto" and not stream.isatty())
    renderer: Any = (structlog.processors.JSONRenderer(serializer=_json_line) if as_json
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
