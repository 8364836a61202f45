"""A bench's result as a dated file: what it printed, the command that made it, and the machine.

Each bench runs inside `Printed()` (what it prints still reaches the terminal) and ends with
`save(...)`, which writes load/results/<YYYY-MM-DD>-<bench>.md (a second run the same day gets
-2, -3...). A figure is only worth its command and its machine: on a small shared box the same
bench moves by up to a third from run to run, so the file says what ran where, and
docs/benchmarks.md points at the folder instead of carrying figures of its own.
"""

from __future__ import annotations

import argparse
import io
import os
import platform
import shlex
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import TextIO

RESULTS = Path(__file__).resolve().parents[1] / "results"


class _Tee(io.TextIOBase):
    def __init__(self, *streams: TextIO) -> None:
        super().__init__()
        self.streams = streams

    def write(self, text: str) -> int:
        for stream in self.streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self.streams:
            stream.flush()


class Printed:
    """What the bench prints to stdout while inside, kept as well as shown."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()
        self._stdout: TextIO | None = None

    def __enter__(self) -> Printed:
        self._stdout = sys.stdout
        sys.stdout = _Tee(self._stdout, self.buffer)
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        if self._stdout is not None:
            sys.stdout = self._stdout

    def text(self) -> str:
        return self.buffer.getvalue()


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--results", type=Path, default=RESULTS, metavar="DIR",
                        help="where the dated result file goes (default: load/results)")


def command(module: str, argv: Sequence[str] | None) -> str:
    """The command line as run: `python -m <module> <its arguments>`."""
    args = sys.argv[1:] if argv is None else argv
    return shlex.join(["python", "-m", module, *args])


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = ", ".join(f"{value:.2f}" for value in os.getloadavg())
    return (f"{os.cpu_count()} cores ({usable} usable by this process), {cpu_model()}; "
            f"{platform.system()} {platform.release()}, Python {platform.python_version()}; "
            f"load average {load} at the end")


def _free_path(directory: Path, stem: str) -> Path:
    path, n = directory / f"{stem}.md", 2
    while path.exists():
        path, n = directory / f"{stem}-{n}.md", n + 1
    return path


def save(module: str, argv: Sequence[str] | None, printed: str, directory: Path = RESULTS,
         now: datetime | None = None) -> Path:
    """Write the dated result of `module` (load.bench.gateway, say) run with `argv` (None: this
    process's own arguments) and return its path."""
    now = now or datetime.now(UTC)
    name = module.removeprefix("load.").replace(".", "-").replace("_", "-")
    directory.mkdir(parents=True, exist_ok=True)
    path = _free_path(directory, f"{now:%Y-%m-%d}-{name}")
    path.write_text(
        f"# {module}, {now:%Y-%m-%d}\n\n"
        f"- command: `{command(module, argv)}`\n"
        f"- finished: {now:%Y-%m-%d %H:%M} UTC\n"
        f"- machine: {machine()}\n\n"
        f"```text\n{printed.rstrip()}\n```\n")
    print(f"result: {path}", file=sys.stderr)
    return path


def recorded(module: str, argv: Sequence[str] | None, directory: Path,
             measure: Callable[[], int]) -> int:
    """Run a bench's `measure` with what it prints kept, and save that as its dated result when
    it succeeded (exit 0); its exit code."""
    with Printed() as printed:
        code = measure()
    if code == 0:
        save(module, argv, printed.text(), directory)
    return code
