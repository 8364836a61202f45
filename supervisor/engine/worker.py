"""The vLLM worker process: its command line, its own session, and a stop that leaves no orphan."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import psutil
import structlog

from appliance.fences.vllm import SERVER_MODULE, Env, Flag
from supervisor.engine.boot_phases import BootPhases
from supervisor.engine.listen import listen_flags, listen_released
from supervisor.engine.worker_output import WorkerOutput
from supervisor.operator.sdnotify import ENV_VARS

if TYPE_CHECKING:  # a type only: the GPU smoke check imports this without pydantic
    from appliance.core.sections import EngineSettings

log = structlog.get_logger("supervisor.engine.worker")

CPU_KV_CACHE_BYTES = 512 * 1024 * 1024
NO_MEDIA_HOST = "none.invalid"
TAIL_LINES = 1000  # the worker's last output lines kept in memory (crashes.log_lines reads them)
PIPE_LINE_LIMIT = 2**16  # bytes per output line, as asyncio's own default; longer lines are skipped


def build_command(engine: EngineSettings, media_hosts: list[str] | None = None) -> list[str]:
    """`python -m <vLLM's server>` with the settings turned into flags; the worker listens on
    its private Unix socket (or loopback TCP: engine.listen)."""
    cpu = engine.resolved_device() == "cpu"
    args = [
        str(engine.python), "-m", SERVER_MODULE,
        Flag.MODEL, engine.model,
        Flag.SERVED_MODEL_NAME, engine.model_name, *engine.served_model_aliases,
        *listen_flags(engine),
        Flag.DTYPE, engine.dtype or ("float32" if cpu else "auto"),
    ]
    if engine.enforce_eager if engine.enforce_eager is not None else cpu:
        args.append(Flag.ENFORCE_EAGER)
    if engine.max_model_len is not None:
        args += [Flag.MAX_MODEL_LEN, str(engine.max_model_len)]
    if engine.max_num_seqs is not None:
        args += [Flag.MAX_NUM_SEQS, str(engine.max_num_seqs)]
    if cpu:
        # One process on the CPU: the multiprocess executor only costs memory there.
        args += [Flag.DISTRIBUTED_EXECUTOR_BACKEND, "uni",
                 Flag.KV_CACHE_MEMORY_BYTES, str(cpu_kv_cache_bytes(engine))]
    else:
        # None: serve could not size it (logged); vLLM's own default applies.
        if engine.gpu_memory_utilization is not None:
            args += [Flag.GPU_MEMORY_UTILIZATION, str(engine.gpu_memory_utilization)]
        if engine.kv_cache_memory_bytes is not None:
            args += [Flag.KV_CACHE_MEMORY_BYTES, str(engine.kv_cache_memory_bytes)]
    if engine.tool_call_parser:
        args += [Flag.ENABLE_AUTO_TOOL_CHOICE, Flag.TOOL_CALL_PARSER, engine.tool_call_parser]
    if engine.reasoning_parser:
        args += [Flag.REASONING_PARSER, engine.reasoning_parser]
    if engine.chat_template is not None:
        args += [Flag.CHAT_TEMPLATE, str(engine.chat_template)]
    if engine.trust_remote_code:
        args.append(Flag.TRUST_REMOTE_CODE)
    # Defence in depth behind the gate's SSRF check: vLLM itself fetches only from these hosts
    # (a reserved, never-resolving name when none is allowed) and follows no redirect.
    args += [Flag.ALLOWED_MEDIA_DOMAINS, *(media_hosts or [NO_MEDIA_HOST])]
    # The gate counts a Responses prompt exactly with the worker's /v1/responses/render, one of
    # vLLM's scale-out routes; they stay with the worker, and the API never exposes them.
    args.append(Flag.ENABLE_SCALE_OUT)
    # The appliance writes every request's access line, with its request id. vLLM's own would
    # say it again, and say every probe's /health and /metrics read besides: each one a line
    # the worker formats and the supervisor reads off the pipe and logs again.
    args.append(Flag.DISABLE_UVICORN_ACCESS_LOG)
    if engine.tokenizer_info:
        args.append(Flag.ENABLE_TOKENIZER_INFO_ENDPOINT)  # read-only: the chat template, specials
    return args + list(engine.extra_args)


def cpu_kv_cache_bytes(engine: EngineSettings) -> int:
    """The KV cache a CPU worker gets: VLLM_CPU_KVCACHE_SPACE (GiB) where its environment sets
    it (vLLM's CPU platform puts it over the flag; vllm/platforms/cpu.py, read from source),
    else the --kv-cache-memory-bytes always passed there."""
    space = {**os.environ, **engine.env}.get(Env.CPU_KVCACHE_SPACE, "")
    with contextlib.suppress(ValueError):  # not a number: vLLM refuses it at its start
        if space:
            return int(space) * 1024**3
    return engine.kv_cache_memory_bytes or CPU_KV_CACHE_BYTES


def build_env(engine: EngineSettings) -> dict[str, str]:
    env = dict(os.environ)
    # Nothing may download weights at run time; the worker reads local directories only.
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
                Env.MEDIA_URL_ALLOW_REDIRECTS: "0"})
    # A LAN appliance reports nothing to the internet: vLLM's usage statistics are off unless
    # the operator turns them on in engine.env.
    env.update({Env.NO_USAGE_STATS: "1", "DO_NOT_TRACK": "1"})
    env.pop("VIRTUAL_ENV", None)
    for key in ENV_VARS:  # systemd's notify socket is the supervisor's alone
        env.pop(key, None)
    if engine.resolved_device() == "cpu":
        env.setdefault(Env.ENABLE_V1_MULTIPROCESSING, "0")
    env[Env.ENABLE_RESPONSES_API_STORE] = "1" if engine.responses_store else "0"
    env.update(cache_env(engine))
    env.update(engine.env)
    return env


def cache_env(engine: EngineSettings) -> dict[str, str]:
    """One cache root that outlives the worker: vLLM puts its torch.compile and Inductor
    caches under VLLM_CACHE_ROOT, so a restart on a GPU loads compiled graphs instead of
    compiling again. Triton's cache is put there too: vLLM moves it under its root only once it
    compiles a graph, so its own Triton kernels would otherwise go to ~/.triton. There the
    memory-profiling result is kept too (vLLM's startup plan, reused only while the model,
    config, hardware and free memory still match). Nothing here matters on the CPU default,
    which runs eager."""
    root = engine.resolved_cache_dir()
    env = {Env.CACHE_ROOT: str(root), "TRITON_CACHE_DIR": str(root / "triton")}
    if engine.resolved_device() == "cuda":
        env[Env.ENABLE_STARTUP_PLAN] = "1"
    return env


@dataclass
class StopReport:
    returncode: int | None
    escalated: bool  # SIGKILL was needed
    stragglers: list[int]  # pids of the tree still alive after the group signal, killed by pid


class Worker(Protocol):
    """A running worker as the manager and the monitors see it, however it was started."""

    pid: int
    tail: deque[str]  # its last output lines, for a crash bundle

    @property
    def returncode(self) -> int | None: ...

    async def wait(self) -> int: ...

    def tree_pids(self) -> set[int]: ...

    async def stop(self, grace_s: float) -> StopReport: ...


class SessionWorker(ABC):
    """A worker that leads its own session: its output re-emitted, its whole tree stopped.

    Subclasses say how its exit is learnt: a child of ours (WorkerProcess) or of the template.
    """

    def __init__(self, pid: int, started_at: float,
                 streams: Iterable[tuple[asyncio.StreamReader, str]]) -> None:
        self.pid = pid
        self.started_at = started_at
        self.boot = BootPhases(started_at)
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self._pumps = [asyncio.create_task(_pump(stream, name, self.boot, self.tail))
                       for stream, name in streams]

    @property
    @abstractmethod
    def returncode(self) -> int | None: ...

    @abstractmethod
    async def wait(self) -> int: ...

    def tree_pids(self) -> set[int]:
        """Every live process in the worker's session: the server, EngineCore, helpers."""
        return {p.pid for p in session_members(self.pid)}

    async def stop(self, grace_s: float) -> StopReport:
        """SIGTERM to the group, grace, SIGKILL to the group, then kill and reap any straggler."""
        frozen = [p.pid for p in session_members(self.pid) if _is_frozen(p)]
        if frozen:  # a SIGSTOPped process cannot act on SIGTERM: waiting the grace is waste
            log.warning("worker.frozen", pids=frozen, action="SIGKILL without grace")
            grace_s = 0.0
        elif self.returncode is not None:  # the server is gone: its leftovers serve no one
            grace_s = 0.0
        _signal_group(self.pid, signal.SIGTERM)
        escalated = False
        if not await _wait_gone(self, grace_s):
            escalated = True
            log.warning("worker.stop_escalated", pid=self.pid, grace_s=grace_s, signal="SIGKILL")
            _signal_group(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError, TimeoutError):
            await asyncio.wait_for(self.wait(), timeout=10)
        stragglers = session_members(self.pid)
        for proc in stragglers:  # a child that left the process group still shares the session
            with contextlib.suppress(psutil.Error):
                proc.kill()
        await asyncio.to_thread(psutil.wait_procs, stragglers, 5)
        for pump in self._pumps:
            pump.cancel()
        return StopReport(self.returncode, escalated, [p.pid for p in stragglers])


class WorkerProcess(SessionWorker):
    """A worker spawned as our own child process."""

    def __init__(self, proc: asyncio.subprocess.Process, exited: asyncio.Future[None],
                 started_at: float) -> None:
        streams = [(s, n) for s, n in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
                   if s is not None]
        super().__init__(proc.pid, started_at, streams)
        self._proc = proc
        self._exited = exited

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait(self) -> int:
        await asyncio.shield(self._exited)
        assert self._proc.returncode is not None
        return self._proc.returncode


class _ExitProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's protocol for a child with pipes, which also says the moment the child ends:
    Process.wait() returns only once its pipes close too, and vLLM's EngineCore holds them
    open for seconds after its server was killed."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=PIPE_LINE_LIMIT, loop=loop)
        self.exited: asyncio.Future[None] = loop.create_future()

    def process_exited(self) -> None:
        super().process_exited()
        if not self.exited.done():
            self.exited.set_result(None)


class ProcessLauncher:
    """Starts real vLLM workers from the engine settings."""

    def __init__(self, engine: EngineSettings, media_hosts: list[str] | None = None) -> None:
        self._engine = engine
        self._media_hosts = media_hosts

    async def start(self) -> WorkerProcess:
        if self._engine.command is None and not Path(self._engine.python).exists():  # noqa: ASYNC240
            raise FileNotFoundError(
                f"engine interpreter {self._engine.python} not found: run install.sh "
                "or set engine.python"
            )
        command = self._engine.command or build_command(self._engine, self._media_hosts)
        await listen_released(self._engine)
        loop = asyncio.get_running_loop()
        transport, protocol = await loop.subprocess_exec(
            lambda: _ExitProtocol(loop),
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=build_env(self._engine),
            start_new_session=True,  # own session and group: one signal reaches EngineCore too
        )
        proc = asyncio.subprocess.Process(transport, protocol, loop)
        log.info("worker.spawned", pid=proc.pid, argv=command)
        return WorkerProcess(proc, protocol.exited, time.monotonic())

    async def aclose(self) -> None:
        """Nothing to release: each worker is stopped by the manager."""


def session_members(sid: int) -> list[psutil.Process]:
    """Live, non-zombie processes whose session id is `sid` (the worker leads its session)."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getsid(proc.pid) == sid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return members


def _is_frozen(proc: psutil.Process) -> bool:
    try:
        return bool(proc.status() == psutil.STATUS_STOPPED)
    except psutil.Error:
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _wait_gone(worker: SessionWorker, timeout_s: float) -> bool:
    """True once the server exited and no other member of its session is alive."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if worker.returncode is not None and not session_members(worker.pid):
            return True
        await asyncio.sleep(0.1)
    return worker.returncode is not None and not session_members(worker.pid)


async def pump_lines(stream: asyncio.StreamReader, line: Callable[[str], None]) -> None:
    """Read a child's output line by line into `line`, until end of file."""
    while True:
        try:
            raw = await stream.readline()
        except ValueError:  # a line beyond the reader's limit: skip it rather than stall the pipe
            continue
        if not raw:
            return
        line(raw.decode(errors="replace").rstrip())


async def _pump(stream: asyncio.StreamReader, name: str, boot: BootPhases,
                tail: deque[str]) -> None:
    """Re-emit the worker's output through structlog, tagged source=worker (see worker_output),
    read the boot phases from it while it boots, and keep its last lines."""
    output = WorkerOutput(name)

    def line(text: str) -> None:
        boot.feed(text)  # logs a boot phase when a line opens one; nothing once ready
        output.line(text)
        tail.append(text)

    try:
        await pump_lines(stream, line)
    finally:
        output.close()
