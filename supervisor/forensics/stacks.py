"""Stack dumps of a hung worker's processes, taken before they are killed.

py-spy (installed into the engine venv by install.sh) reads each Python thread's stack from
outside, without the process's help: it works on a SIGSTOPped or deadlocked process, where
faulthandler and the like cannot run. `--nonblocking` reads without pausing the process.
It needs ptrace rights over the worker: the same user, and where the kernel's Yama
ptrace_scope is 1 (Ubuntu's default) also CAP_SYS_PTRACE, which the system unit does not grant;
its refusal is then what the bundle records. Each process's threads and their kernel wait
channels (/proc) are recorded in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
from pathlib import Path

import structlog

log = structlog.get_logger("supervisor.forensics.stacks")

_OUTPUT_LIMIT = 256 * 1024  # bytes of one dump: the bundle trims further to fit


def find_py_spy(engine_python: Path) -> str | None:
    """py-spy beside the engine's interpreter, beside ours, or on PATH."""
    for folder in (engine_python.parent, Path(sys.executable).parent):
        candidate = folder / "py-spy"
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("py-spy")


async def dump_stacks(pids: list[int], py_spy: str | None, timeout_s: float) -> dict[str, str]:
    """Each pid's stacks (py-spy) and threads (/proc), all processes at once within `timeout_s`."""
    found = await asyncio.gather(*(_one(pid, py_spy, timeout_s) for pid in pids))
    return {str(pid): text for pid, text in zip(pids, found, strict=True)}


async def _one(pid: int, py_spy: str | None, timeout_s: float) -> str:
    threads = proc_threads(pid)
    if py_spy is None:
        return "py-spy: not installed (install.sh puts it in the engine venv)\n" + threads
    try:
        child = await asyncio.create_subprocess_exec(
            py_spy, "dump", "--nonblocking", "--pid", str(pid),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    except OSError as error:
        return f"py-spy: {error.strerror or error}\n" + threads
    try:
        async with asyncio.timeout(timeout_s):
            out, _ = await child.communicate()
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
        return f"py-spy: no dump within {timeout_s:g}s\n" + threads
    text = out[:_OUTPUT_LIMIT].decode("utf-8", "replace")
    if child.returncode != 0:
        log.warning("crash.py_spy_failed", pid=pid, returncode=child.returncode)
    return text + "\n" + threads


def proc_threads(pid: int) -> str:
    """One line per thread: id, name, state, and the kernel function it waits in."""
    lines = [f"threads of {pid} (tid name state wchan):"]
    try:
        tids = sorted(os.listdir(f"/proc/{pid}/task"), key=int)
    except OSError as error:
        return f"threads of {pid}: {error.strerror}"
    for tid in tids:
        base = f"/proc/{pid}/task/{tid}"
        try:
            with open(f"{base}/stat", "rb") as handle:
                stat = handle.read()
            with open(f"{base}/wchan") as handle:
                wchan = handle.read().strip() or "-"
        except OSError:
            continue
        close = stat.rfind(b")")
        name = stat[stat.find(b"(") + 1:close].decode("utf-8", "replace")
        state = stat[close + 2:close + 3].decode()
        lines.append(f"{tid} {name} {state} {wchan}")
    return "\n".join(lines)
