"""The worker template's trial fork: proof that a child forked from it can use the thread pools
its preloads brought, before any worker is forked.

Loaded by path by engine_side.py (the engine venv's `supervisor` distribution shadows this
package there), so it imports only the standard library.

A fork copies one thread; a lock or pool state held by another stays as it was. What the
preloads start (`import torch` imports numpy): numpy's OpenBLAS starts its pool (one thread per
core but one) at import, and its own pthread_atfork handler joins that pool before every fork,
so a child rebuilds it. torch's OpenMP pool (libgomp) starts at its first parallel operation, has
no such handler, and a child forked after it hangs in its first parallel operation (measured on
this project's CPU engine venv: torch 2.13, libgomp). The template computes nothing, so no pool
is busy at a fork and its state cannot change after boot; one trial child at boot, doing what a
worker does first with each pool, shows whether forking is safe for this template's life.
Where it is not, the template fails and the supervisor spawns workers instead.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import traceback
import warnings
from collections.abc import Mapping
from typing import Any

# Above torch's grain size (32768 elements): the operation runs on torch's intra-op pool.
PARALLEL_ELEMENTS = 1 << 20
MATRIX = 256  # enough for a BLAS library to split the product across its threads


def use_pools(modules: Mapping[str, Any]) -> None:
    """What a worker does first with each pool the preloads may have started."""
    torch = modules.get("torch")
    if torch is not None:
        torch.ones(PARALLEL_ELEMENTS).add_(1)
        torch.mm(torch.ones(MATRIX, MATRIX), torch.ones(MATRIX, MATRIX))
    numpy = modules.get("numpy")
    if numpy is not None:
        square = numpy.ones((MATRIX, MATRIX))
        square @ square  # computed for its pool, not its value


def fork() -> int:
    """os.fork without Python's warning that the process has threads: the trial fork is the
    check of those threads, and the filter is the caller's again on both sides of the fork."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return os.fork()


def trial_fork(timeout_s: float, modules: Mapping[str, Any] | None = None) -> str | None:
    """None when a forked child used the pools and exited 0 within timeout_s, else why not.
    modules: the seam (default: sys.modules)."""
    modules = sys.modules if modules is None else modules
    pid = fork()
    if pid == 0:
        _child(modules)
    pidfd = os.pidfd_open(pid)
    try:
        ended = select.select([pidfd], [], [], timeout_s)[0]
    finally:
        os.close(pidfd)
    if not ended:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        return (f"a child forked from the template hung for {timeout_s:g}s in its first use of "
                "the preloads' thread pools (an OpenMP pool started before the fork?)")
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    return None if code == 0 else f"a child forked from the template failed (exit status {code})"


def _child(modules: Mapping[str, Any]) -> None:
    code = 0
    try:
        use_pools(modules)
    except BaseException:  # any failure is the parent's verdict; it reads the exit status
        traceback.print_exc()
        code = 1
    os._exit(code)  # the template's atexit handlers and buffers are the template's, not ours
