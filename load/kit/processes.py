"""Stopping a process a test or a benchmark started."""

from __future__ import annotations

import signal
import subprocess


def terminate(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, up to grace_s for it to go, then SIGKILL; reaped either way."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
