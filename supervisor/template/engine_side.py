"""The worker template: an engine-venv process that imports vLLM once and forks every worker.

Run BY PATH with the engine venv's interpreter, never imported: the engine venv holds the
`supervisor` distribution (supervisord), whose import name collides with this package, so this
file imports nothing from the repository as a package, only the standard library, what it
preloads, and by path its sibling engine_fork.py and the vLLM contract
(appliance/fences/vllm.py).

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

With --engine-core-fork, EngineCore is forked where that is safe: see engine_fork.py, loaded by
path from this directory.

"Holds no GPU" means no CUDA context, as the CUDA driver and torch say (cuda_state.py, loaded
by path from this directory), never as open files say: NVML opens /dev/nvidiactl, /dev/nvidiaN
and, on driver 580, /dev/nvidia-uvm too (torch asks NVML for the device count and never shuts it
down, and `import vllm` can make it ask), and a child forked then still uses CUDA. The device
files held are reported (`nvml_files`), not refused. python -m supervisor.smoke.check checks it on
a GPU.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import gc
import importlib
import importlib.util
import json
import os
import runpy
import selectors
import signal
import socket
import sys
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

# Running a file by path puts its directory first on sys.path: this repository's modules would
# shadow same-named ones of the engine venv (supervisor, backoff, ...).
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    del sys.path[0]


def load_by_path(name: str, *relative: str) -> ModuleType:
    """A module of the repository, by its path from this directory, under a name no
    distribution uses."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), *relative)
    spec = importlib.util.spec_from_file_location(f"chat_appliance_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# vLLM's module paths and names, which engine_fork reads under this name (appliance/fences/vllm.py)
load_by_path("vllm_contract", os.pardir, os.pardir, "appliance", "fences", "vllm.py")
cuda_state = load_by_path("cuda_state", "cuda_state.py")  # engine_fork reads it under this name
fork_probe = load_by_path("fork_probe", "fork_probe.py")
engine_fork = load_by_path("engine_fork", "engine_fork.py")

MAX_MESSAGE_BYTES = 1 << 20
START_FDS = 2  # the worker's stdout and stderr


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
                        help="fork vLLM's EngineCore where that is safe")
    parser.add_argument("--trial-fork-timeout-s", type=float, default=10.0,
                        help="how long the trial child forked at boot may take")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    control = socket.socket(fileno=args.control_fd)
    began = time.monotonic()
    before = dict(os.environ)
    try:
        for name in args.preload:
            importlib.import_module(name)
        skipped = warm(args.warm)
        if args.engine_core_fork:
            engine_fork.install_engine_core_fork_policy()
    except Exception as exc:  # third-party imports can raise anything; reported, then exit 1
        send(control, {"event": "failed", "error": f"preload: {type(exc).__name__}: {exc}"})
        return 1
    cuda = cuda_state.cuda_state()
    if cuda.initialised:
        send(control, {"event": "failed", "error": f"the preloads initialised CUDA ({cuda.reason})"})
        return 1
    threads = len(engine_fork.thread_names())  # before the trial: OpenBLAS joins its pool at a fork
    unsafe = fork_probe.trial_fork(args.trial_fork_timeout_s)
    if unsafe is not None:
        send(control, {"event": "failed", "error": unsafe})
        return 1
    import_env = changed_environment(before, dict(os.environ))
    # What the preloads built lives as long as any worker: keep the collector off it, so a
    # worker's gc.collect() neither walks it (seconds, for vLLM) nor copies its pages on write.
    gc.collect()
    gc.freeze()
    facts = ready_facts(args.preload, skipped, time.monotonic() - began) | {"threads": threads}
    send(control, facts | {"nvml_files": open_files("/dev/nvidia"), "cuda": cuda.reason,
                           "import_env": sorted(import_env)})
    start = serve(control)
    if start is None:
        return 0
    start.env = worker_environment(start.env, before, import_env)
    return run_child(start)


def changed_environment(before: dict[str, str], after: dict[str, str]) -> dict[str, str | None]:
    """What the preloads did to os.environ (`import vllm` sets a few): name → value, None when
    they removed it."""
    changed: dict[str, str | None] = {k: v for k, v in after.items() if before.get(k) != v}
    return changed | {key: None for key in before.keys() - after.keys()}


def worker_environment(sent: dict[str, str], before: dict[str, str],
                       import_env: dict[str, str | None]) -> dict[str, str]:
    """The environment a spawned worker would have once it had imported the preloads: the one
    sent, with what the imports changed, where the sent value is the one they changed."""
    env = dict(sent)
    for key, value in import_env.items():
        if sent.get(key) != before.get(key):
            continue  # the supervisor set it otherwise since the template started: its value
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


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
        "cuda_initialized": False,
        "vllm_version": getattr(vllm, "__version__", None),
    }


def open_files(prefix: str) -> list[str]:
    """Paths under `prefix` this process holds open: reported, never a verdict on CUDA."""
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
                pid = fork_probe.fork()  # its threads were proven at boot (trial_fork)
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
        print(engine_fork.LOG_PREFIX, f"channel closed: killed workers {pids}", file=sys.stderr, flush=True)


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
