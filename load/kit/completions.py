"""A streamed /v1/completions request read to its end, as a client sees it: its text, when its
first token came, and whether it ended as a clean stream does ([DONE], no error event)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx


@dataclass(frozen=True)
class Streamed:
    status: int
    text: str
    first_token_s: float  # 0 where no text came
    total_s: float
    clean: bool  # ended with [DONE] and no error event


def stream_completion(url: str, body: dict[str, Any], *, timeout_s: float = 600,
                      on_first_text: Callable[[], None] | None = None) -> Streamed:
    """POST `body` (streamed) to `url`/v1/completions; `on_first_text` is called once, when the
    first piece of text has come (to strike a fault into the stream, say)."""
    started = time.monotonic()
    text, first, done, error = "", 0.0, False, False
    with httpx.stream("POST", f"{url}/v1/completions", json=body | {"stream": True},
                      timeout=timeout_s) as response:
        for line in response.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            error |= "error" in event
            text += "".join(choice.get("text") or "" for choice in event.get("choices", []))
            if text and not first:
                first = time.monotonic() - started
                if on_first_text is not None:
                    on_first_text()
        return Streamed(response.status_code, text, first, time.monotonic() - started,
                        done and not error)
