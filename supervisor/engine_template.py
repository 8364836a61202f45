"""The worker template: an engine-venv process that imports vLLM once and forks every worker.

Run BY PATH with the engine venv's interpreter, never imported: the engine venv holds the
`supervisor` distribution (supervisord), whose import name collides with this package, so this
file imports nothing from the repository, only the standard library and what it preloads.

Control channel: a SOCK_SEQPACKET socket passed as --control-fd; one JSON object per message.
  template -> supervisor   {"event": "ready", facts...} once the preloads are imported
                           {"event": "failed", "error"} when they cannot be (then it exits 1)
                           {"event": "started", "pid"} / {"event": "refused", "error"}
                           {"event": "exited", "pid", "returncode"} when it reaps a worker
  supervisor -> template   {"op": "start", "argv", "env", "cwd"} with two SCM_RIGHTS fds:
                           the worker's stdout and stderr
The template never serves. Each start forks a child that leads its own session, takes the fds
as 1 and 2 (stdin: /dev/null), the argv, environment and cwd it was sent, and runs the module
exactly as `python -m` would; its exit is the interpreter's ordinary exit. End of file on the
channel (the supervisor is gone, or let this template go) ends the template, and kills the
process groups of the workers it still has: none may run unsupervised.

With --engine-core-fork, vLLM's choice of multiprocessing start method is wrapped: on the CPU
platform, where vLLM forces "spawn" to protect OpenMP thread pools, EngineCore (and any executor
worker) is forked instead when, at that moment, the forking process runs no thread but its own
and libzmq's background threads: no OpenMP or BLAS pool exists yet, so none can be broken by the
fork. Otherwise vLLM's own choice stands and the worker's stderr says why.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import gc
import importlib
import json
import multiprocessing
import os
import runpy
import selectors
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Running a file by path puts its directory first on sys.path: this repository's modules would
# shadow same-named ones of the engine venv (supervisor, backoff, ...).
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]

MAX_MESSAGE_BYTES = 1 << 20
START_FDS = 2  # the worker's stdout and stderr
# libzmq names its I/O and reaper threads; a forked child never touches the parent's context.
FORK_SAFE_THREAD_PREFIXES = ("ZMQbg/",)
# A new thread carries the process's name until it names itself: wait that long for names.
THREAD_NAME_SETTLE_S = 0.5
LOG_PREFIX = "chat-appliance engine_template:"


@dataclass
class Start:
    """What one forked worker runs: the argv of `python -m module ...`, its env, cwd, fds."""

    argv: list[str]
    env: dict[str, str]
    cwd: str
    fds: list[int]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="the worker template of chat-appliance")
    parser.add_argument("--control-fd", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[], help="module to import once")
    parser.add_argument("--warm", action="append", default=[],
                        help="module to import once if it can be (vLLM versions differ)")
    parser.add_argument("--engine-core-fork", action="store_true",
                        help="fork vLLM's EngineCore on the CPU where that is safe")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    began = time.monotonic()
    try:
        for name in args.preload:
            importlib.import_module(name)
        skipped = warm(args.warm)
        if args.engine_core_fork:
            install_engine_core_fork_policy()
    except Exception as exc:  # third-party imports can raise anything; reported, then exit 1
        send(control, {"event": "failed", "error": f"preload: {type(exc).__name__}: {exc}"})
        return 1
    gpu_files = open_files("/dev/nvidia")
    if cuda_initialized() or gpu_files:
        send(control, {"event": "failed",
                       "error": f"the preloads touched the GPU (CUDA context, open {gpu_files})"})
        return 1
    # What the preloads built lives as long as any worker: keep the collector off it, so a
    # worker's gc.collect() neither walks it (seconds, for vLLM) nor copies its pages on write.
    gc.collect()
    gc.freeze()
    send(control, ready_facts(args.preload, skipped, time.monotonic() - began))
    start = serve(control)
    if start is None:
        return 0
    return run_child(start)


def warm(names: list[str]) -> list[str]:
    """Import what can be imported; the names that could not (they only cost time later)."""
    skipped = []
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            skipped.append(name)
    return skipped


def ready_facts(preloaded: list[str], skipped: list[str], import_s: float) -> dict[str, Any]:
    vllm = sys.modules.get("vllm")
    return {
        "event": "ready", "pid": os.getpid(), "executable": sys.executable,
        "site_packages": [p for p in sys.path if p.endswith("site-packages")],
        "preloaded": preloaded, "skipped": skipped, "modules": len(sys.modules),
        "import_s": round(import_s, 2),
        "threads": len(thread_names()), "cuda_initialized": False,
        "vllm_version": getattr(vllm, "__version__", None),
    }


def cuda_initialized() -> bool:
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def open_files(prefix: str) -> list[str]:
    """Paths under `prefix` this process holds open (a CUDA context holds /dev/nvidia*)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the fd that listed the directory is gone
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(prefix):
                found.append(target)
    return found


# --- the template's loop -----------------------------------------------------------------------


def serve(control: socket.socket) -> Start | None:
    """Answer start requests and report exits; returns None at end of file, a Start in a child."""
    children: dict[int, int] = {}  # pidfd -> pid
    with selectors.DefaultSelector() as selector:
        selector.register(control, selectors.EVENT_READ)
        while True:
            for key, _ in selector.select():
                if key.fileobj is not control:
                    reap(control, selector, key.fd, children.pop(key.fd))
                    continue
                message, fds = receive(control)
                if message is None:
                    kill_workers(list(children.values()))
                    return None
                start = validate(message, fds)
                if isinstance(start, str):
                    close_all(fds)
                    send(control, {"event": "refused", "error": start})
                    continue
                pid = os.fork()
                if pid == 0:
                    close_all([control.detach(), *children])
                    return start
                close_all(fds)
                pidfd = os.pidfd_open(pid)
                children[pidfd] = pid
                selector.register(pidfd, selectors.EVENT_READ)
                send(control, {"event": "started", "pid": pid})


def kill_workers(pids: list[int]) -> None:
    """The supervisor is gone or let go of this template: no worker of ours may outlive that
    unsupervised (under systemd the unit's cgroup would go the same way)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    if pids:
        print(LOG_PREFIX, f"channel closed: killed workers {pids}", file=sys.stderr, flush=True)


def reap(control: socket.socket, selector: selectors.BaseSelector, pidfd: int, pid: int) -> None:
    selector.unregister(pidfd)
    os.close(pidfd)
    _, status = os.waitpid(pid, 0)
    send(control, {"event": "exited", "pid": pid, "returncode": os.waitstatus_to_exitcode(status)})


def validate(message: dict[str, Any], fds: list[int]) -> Start | str:
    """A Start the template can run as the spawned worker would run, or why not."""
    if message.get("op") != "start":
        return f"unknown op {message.get('op')!r}"
    argv, env, cwd = message.get("argv"), message.get("env"), message.get("cwd")
    if not (isinstance(argv, list) and len(argv) >= 2 and all(isinstance(a, str) for a in argv)):
        return "argv must be a list of strings: [python, -m, module, ...] or [python, script, ...]"
    if os.path.abspath(argv[0]) != sys.executable:
        return f"argv[0] {argv[0]} is not this template's interpreter {sys.executable}"
    if argv[1].startswith("-") and (argv[1] != "-m" or len(argv) < 3):
        return f"interpreter option {argv[1]} is not supported: only -m module"
    if not isinstance(env, dict) or not isinstance(cwd, str):
        return "env must be an object and cwd a string"
    if len(fds) != START_FDS:
        return f"expected {START_FDS} fds (stdout, stderr), got {len(fds)}"
    return Start(argv, {str(k): str(v) for k, v in env.items()}, cwd, fds)


# --- the forked worker -------------------------------------------------------------------------


def run_child(start: Start) -> int:
    """Become the worker: own session, the passed fds, argv, env and cwd; then `python -m`."""
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(start.fds[0], 1)
    os.dup2(start.fds[1], 2)
    close_all([devnull, *start.fds])
    os.chdir(start.cwd)
    apply_environment(start.env)
    show_command_line(start.argv)
    if start.argv[1] == "-m":
        sys.path.insert(0, os.getcwd())  # what `python -m` puts first
        sys.argv = start.argv[2:]  # runpy replaces argv[0] with the module's file, as -m does
        runpy.run_module(start.argv[2], run_name="__main__", alter_sys=True)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(start.argv[1])))
        sys.argv = start.argv[1:]
        runpy.run_path(start.argv[1], run_name="__main__")
    return 0


def show_command_line(argv: list[str]) -> None:
    """`ps` shows the worker's own command line, as for a spawned worker, not the template's;
    its short name (comm) stays the interpreter's, which setproctitle would also change."""
    try:
        setproctitle = importlib.import_module("setproctitle")
    except ImportError:  # not in this venv: the template's command line stays
        return
    with open("/proc/self/comm") as comm:
        name = comm.read().strip()
    setproctitle.setproctitle(" ".join(argv))
    with open("/proc/self/comm", "w") as comm:
        comm.write(name)


def apply_environment(env: dict[str, str]) -> None:
    """Make os.environ exactly `env`, touching only what differs. The supervisor starts the
    template with the workers' environment, so normally nothing is touched: rewriting environ
    would move it away from argv, where setproctitle looks for the memory it may reuse (vLLM
    names its processes VLLM::EngineCore and so on with it)."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    for key, value in env.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


# --- EngineCore by fork ------------------------------------------------------------------------


def install_engine_core_fork_policy() -> None:
    """Route every vLLM lookup of get_mp_context through the fork policy below."""
    system_utils = importlib.import_module("vllm.utils.system_utils")
    vllm_choice = system_utils.get_mp_context
    policy = engine_mp_context(vllm_choice)
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict) and namespace.get("get_mp_context") is vllm_choice:
            setattr(module, "get_mp_context", policy)  # noqa: B010 (a module of vLLM's, untyped)


def engine_mp_context(vllm_choice: Callable[[], Any]) -> Callable[[], Any]:
    def get_mp_context() -> Any:
        context = vllm_choice()
        if context.get_start_method() != "spawn" or not cpu_platform():
            return context  # vLLM's own choice: fork where it allows it (CUDA), or a reason
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


def cpu_platform() -> bool:
    return bool(importlib.import_module("vllm.platforms").current_platform.is_cpu())


def fork_unsafe_reasons() -> list[str]:
    reasons = []
    if "--numa-bind" in sys.argv:
        reasons.append("--numa-bind needs spawn")
    if cuda_initialized():
        reasons.append("CUDA is initialised")
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


# --- the channel -------------------------------------------------------------------------------


def send(control: socket.socket, message: dict[str, Any]) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # supervisor gone: EOF next
        control.send(json.dumps(message).encode())


def receive(control: socket.socket) -> tuple[dict[str, Any] | None, list[int]]:
    fds = array.array("i")
    try:
        data, ancillary, _, _ = control.recvmsg(MAX_MESSAGE_BYTES, socket.CMSG_SPACE(START_FDS * 4))
    except ConnectionResetError:
        return None, []
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if not data:
        close_all(list(fds))
        return None, []
    try:
        message = json.loads(data)
    except ValueError:
        message = {"op": "unreadable"}
    return (message if isinstance(message, dict) else {"op": "unreadable"}), list(fds)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


if __name__ == "__main__":
    sys.exit(main())
