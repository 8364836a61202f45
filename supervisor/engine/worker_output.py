"""The worker's output, made readable: each line re-emitted, a traceback as one compact event.

vLLM prints a Python traceback (80 lines is common) for every request its server fails; one log
event per line floods the log. A traceback is gathered and emitted once, with its exception line
and the innermost frame, and its line count. Memory is bounded: a traceback longer than
MAX_LINES is emitted at that point with what was gathered.
"""

from __future__ import annotations

import re

import structlog

log = structlog.get_logger("supervisor.engine.worker")

MAX_LINES = 400
# vLLM prefixes its processes' lines, e.g. "(APIServer pid=123) " or "(EngineCore pid=9) ".
_PREFIX = re.compile(r"^\([A-Za-z_]+ pid=\d+\) ")
_START = "Traceback (most recent call last):"
_CHAINED = ("During handling of the above exception", "The above exception was the direct cause")


class WorkerOutput:
    """Feed it the worker's lines of one stream, in order; it logs them."""

    def __init__(self, stream: str) -> None:
        self._stream = stream
        self._traceback: list[str] = []

    def line(self, raw: str) -> None:
        text = _PREFIX.sub("", raw)
        if self._traceback:
            if text.startswith((" ", "\t")) or text.startswith(_CHAINED) or text == "" \
                    or text.startswith(_START):
                self._traceback.append(text)
                if len(self._traceback) >= MAX_LINES:
                    self._flush(None)
                    self._traceback = ["(traceback continued)"]
                return
            self._flush(text)
            return
        if text.startswith(_START):
            self._traceback = [text]
            return
        log.info("worker.output", source="worker", stream=self._stream, line=raw)

    def close(self) -> None:
        if self._traceback:
            self._flush(None)

    def _flush(self, error: str | None) -> None:
        lines, self._traceback = self._traceback, []
        frames = [line.strip() for line in lines if line.strip().startswith("File ")]
        log.warning("worker.traceback", source="worker", stream=self._stream,
                    error=error or "(incomplete)", where=frames[-1] if frames else None,
                    frames=len(frames), lines=len(lines) + (error is not None))
