"""EngineCore by fork where that is safe: the policy the worker template installs.

Loaded by path by supervisor/template/engine_side.py (the engine venv's `supervisor` distribution
shadows this package there), so it imports nothing from the repository.

vLLM spawns EngineCore (and any executor worker) on every platform when started as the API
server: its CPU platform forces "spawn" to protect OpenMP thread pools (a fork copies a pool's
state but not its threads), and on a GPU the server's entry point calls vLLM's cli_env_setup(),
which sets VLLM_WORKER_MULTIPROC_METHOD=spawn unless it is set (read in vLLM 0.32's source).
Spawn costs a fresh interpreter and vLLM's imports again, ~13 s each on the CPU here. The policy
wraps vLLM's get_mp_context: when vLLM says spawn, it forks instead if, at that moment, none of
the reasons vLLM itself has for spawn holds (CUDA initialised in the forking process, WSL,
--numa-bind) and the process runs no thread but its own and libzmq's background threads (which
the child never uses), so no OpenMP or BLAS pool exists yet; otherwise vLLM's choice stands and
stderr says why. On a GPU the API server process never initialises CUDA (the template proves it
holds no CUDA context, and the check here is repeated at the fork): the forked EngineCore is
the first to.
"""

from __future__ import annotations

import contextlib
import importlib
import multiprocessing
import os
import platform
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# vLLM's names: the contract module, which engine_side.py loads by path under this name in the
# engine venv (where the repository is no package to import from).
contract = (sys.modules.get("chat_appliance_vllm_contract")
            or importlib.import_module("appliance.fences.vllm"))
cuda_state = (sys.modules.get("chat_appliance_cuda_state")
              or importlib.import_module("supervisor.template.cuda_state"))
# libzmq names its I/O and reaper threads; a forked child never touches the parent's context.
FORK_SAFE_THREAD_PREFIXES = ("ZMQbg/",)
# A new thread carries the process's name until it names itself: wait that long for names.
THREAD_NAME_SETTLE_S = 0.5
LOG_PREFIX = "chat-appliance engine_template:"


def install_engine_core_fork_policy() -> None:
    """Route every vLLM lookup of get_mp_context through the fork policy below."""
    system_utils = importlib.import_module(contract.MP_CONTEXT_MODULE)
    vllm_choice = getattr(system_utils, contract.MP_CONTEXT_FUNCTION)
    policy = engine_mp_context(vllm_choice)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get(contract.MP_CONTEXT_FUNCTION) is vllm_choice:
            setattr(module, contract.MP_CONTEXT_FUNCTION, policy)


def engine_mp_context(vllm_choice: Callable[[], Any]) -> Callable[[], Any]:
    def get_mp_context() -> Any:
        context = vllm_choice()
        if context.get_start_method() != "spawn":
            return context  # vLLM's own choice: fork already
        unsafe = fork_unsafe_reasons()
        if unsafe:
            print(LOG_PREFIX, "start_method=spawn reasons=" + "; ".join(unsafe), file=sys.stderr)
            return context
        print(LOG_PREFIX, "start_method=fork threads=" + ",".join(thread_names().values()), file=sys.stderr)
        return EngineForkContext()

    return get_mp_context


class EngineForkProcess(multiprocessing.context.ForkProcess):
    """A forked engine process that lets go of its parent's listening sockets first.

    A spawned EngineCore never holds the API server's port; a forked one would keep it bound
    after the server dies, so connections would hang in its backlog instead of being refused.
    """

    def run(self) -> None:
        release_listening_sockets()
        super().run()


class EngineForkContext(multiprocessing.context.ForkContext):
    Process = EngineForkProcess


def release_listening_sockets() -> None:
    """Point every inherited listening socket's fd at /dev/null: the socket is released, and
    the fd number stays taken, so the parent's socket object cannot close a reused fd later."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        for fd in (int(name) for name in os.listdir("/proc/self/fd")):
            if fd != devnull and is_listening_socket(fd):
                os.dup2(devnull, fd)
    finally:
        os.close(devnull)


def is_listening_socket(fd: int) -> bool:
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return False
        copy = os.dup(fd)
    except OSError:  # gone meanwhile: the fd that listed /proc/self/fd
        return False
    try:
        probe = socket.socket(fileno=copy)
    except OSError:  # a family Python does not know
        os.close(copy)
        return False
    with probe:
        try:
            return probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) == 1
        except OSError:
            return False


def fork_unsafe_reasons() -> list[str]:
    reasons = []
    if contract.Flag.NUMA_BIND in sys.argv:
        reasons.append(f"{contract.Flag.NUMA_BIND} needs spawn")
    cuda = cuda_state.cuda_state()
    if cuda.initialised:
        reasons.append(f"CUDA is initialised ({cuda.reason})")
    if "microsoft" in platform.uname().release.lower():
        reasons.append("WSL: NVML does not survive a fork there")
    foreign = foreign_threads()
    if foreign:
        reasons.append(f"{len(foreign)} thread(s) besides the main one and libzmq's: {foreign}")
    return reasons


def foreign_threads() -> list[str]:
    """Threads other than the caller's and libzmq's, after their names had time to settle."""
    deadline = time.monotonic() + THREAD_NAME_SETTLE_S
    own = threading.get_native_id()
    while True:
        foreign = [name for tid, name in thread_names().items()
                   if tid != own and not name.startswith(FORK_SAFE_THREAD_PREFIXES)]
        if not foreign or time.monotonic() >= deadline:
            return foreign
        time.sleep(0.02)


def thread_names() -> dict[int, str]:
    names = {}
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{tid}/comm") as comm:
            names[int(tid)] = comm.read().strip()  # OSError: a thread that ended while we looked
    return names

