"""The template's trial fork: a child forked from it must be able to use the thread pools its
preloads brought, checked with the real torch and numpy of the engine venv and with fakes."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
import time
import types
from pathlib import Path

import pytest

from appliance.core.sections import default_engine_python
from supervisor.template.fork_probe import trial_fork

TEMPLATE_DIR = Path(__file__).resolve().parents[4] / "supervisor" / "template"

# A template-like process: torch imported (numpy's OpenBLAS pool running), nothing computed;
# it forks as the template forks workers, each child using every pool; then it starts torch's
# OpenMP pool, as a preload that computed something would, and tries again.
TEMPLATE_LIKE = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, sys.argv[1])
    import numpy, torch
    import fork_probe
    threads = len(os.listdir("/proc/self/task"))
    seen = {"threads_after_import": threads, "trial": fork_probe.trial_fork(30)}
    exits = []
    for _ in range(5):
        pid = fork_probe.fork()
        if pid == 0:
            fork_probe.use_pools(sys.modules)
            os._exit(0)
        exits.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    seen["workers"] = exits
    torch.ones(1 << 20).add_(1)
    seen["pool_threads"] = torch.get_num_threads()
    seen["trial_after_a_parallel_op"] = fork_probe.trial_fork(2)
    print(json.dumps(seen))
""")


def test_with_torch_and_numpy_imported_forked_children_use_every_pool() -> None:
    """What the template is after `import torch`: OpenBLAS's pool (numpy) runs, and its own
    atfork handler makes the fork safe; once torch's OpenMP pool has run, a child hangs, and the
    trial says so."""
    python = default_engine_python()
    if not python.exists():
        pytest.skip(f"no engine venv at {python}")
    done = subprocess.run([str(python), "-c", TEMPLATE_LIKE, str(TEMPLATE_DIR)], capture_output=True,
                          text=True, timeout=120, check=True)
    seen = json.loads(done.stdout)
    assert seen["trial"] is None and seen["workers"] == [0] * 5
    if seen["pool_threads"] > 1:  # one core: torch has no pool to hang in
        assert "hung for 2s" in seen["trial_after_a_parallel_op"]


def test_a_child_that_hangs_is_killed_and_named() -> None:
    def never(*_: int) -> None:
        time.sleep(3600)

    began = time.monotonic()
    verdict = trial_fork(0.5, {"torch": types.SimpleNamespace(ones=never)})
    assert verdict is not None and "hung for 0.5s" in verdict
    assert time.monotonic() - began < 5


def test_a_child_that_fails_is_named_with_its_exit_status() -> None:
    def broken(*_: int) -> None:
        raise RuntimeError("no pool")

    verdict = trial_fork(10, {"torch": types.SimpleNamespace(ones=broken)})
    assert verdict == "a child forked from the template failed (exit status 1)"


def test_nothing_to_use_is_a_safe_fork() -> None:
    assert trial_fork(10, {}) is None


def test_a_hung_child_is_reaped() -> None:
    def never(*_: int) -> None:
        time.sleep(3600)

    trial_fork(0.2, {"torch": types.SimpleNamespace(ones=never)})
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)
