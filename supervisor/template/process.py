"""The worker template's process, seen from the supervisor, and the workers it forks.

The template (supervisor/template/engine_side.py, run by path in the engine venv) imports vLLM once
and forks each worker on request; a forked worker leads its own session like a spawned one and
is supervised the same way (SessionWorker): its exit comes from the template's report, its stop
signals its process group. When to use, replace or give up a template is supervisor/engine/launcher.py's.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import json
import os
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

from supervisor.engine.worker import SessionWorker, StopReport, pump_lines

log = structlog.get_logger("supervisor.template.process")

TEMPLATE_SCRIPT = Path(__file__).with_name("engine_side.py")
MAX_MESSAGE_BYTES = 1 << 20
MAX_TEMPLATE_FAILURES = 3  # consecutive deaths or failed boots before spawning for good
EXIT_UNKNOWN = 255  # a worker whose template died before reaping it: its status is lost
EXIT_REPORT_GRACE_S = 2.0  # how long a worker seen gone may wait for the template's report
CLOSE_GRACE_S = 5.0


# The template's answer to a start: its message, and the worker's exit status to come (None when
# it refused).
StartReply = tuple[dict[str, Any], "asyncio.Future[int] | None"]


class TemplateError(Exception):
    """The template cannot serve this start; the message says why."""


class ForkedWorker(SessionWorker):
    """A worker forked by the template: its exit status arrives on the template's channel.

    A pidfd on the worker backs the report up: if the template is gone, or says nothing within
    EXIT_REPORT_GRACE_S of the worker's end, the status is taken as lost (EXIT_UNKNOWN).
    """

    def __init__(self, pid: int, streams: list[tuple[asyncio.StreamReader, str]],
                 exit_status: asyncio.Future[int], transports: list[asyncio.BaseTransport]) -> None:
        super().__init__(pid, time.monotonic(), streams)
        self._exit = exit_status
        self._transports = transports
        self._pidfd = _watch_pid(pid, self._seen_gone)

    @property
    def returncode(self) -> int | None:
        return self._exit.result() if self._exit.done() else None

    async def wait(self) -> int:
        return await asyncio.shield(self._exit)

    async def stop(self, grace_s: float) -> StopReport:
        report = await super().stop(grace_s)
        for transport in self._transports:
            transport.close()
        self._close_pidfd()
        return report

    def _seen_gone(self) -> None:
        self._close_pidfd()
        asyncio.get_running_loop().call_later(EXIT_REPORT_GRACE_S, self._status_lost)

    def _status_lost(self) -> None:
        if not self._exit.done():
            log.warning("worker.exit_status_lost", pid=self.pid, returncode=EXIT_UNKNOWN,
                        reason="the template did not report the worker's exit")
            self._exit.set_result(EXIT_UNKNOWN)

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            asyncio.get_running_loop().remove_reader(self._pidfd)
            os.close(self._pidfd)
            self._pidfd = None


class TemplateProcess:
    """One running template: its process, its control channel, the exits it reports."""

    def __init__(self, proc: asyncio.subprocess.Process, sock: socket.socket,
                 env: dict[str, str]) -> None:
        self.proc = proc
        self.env = env
        self.facts: dict[str, Any] = {}
        self._sock = sock
        self._ready: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._replies: collections.deque[asyncio.Future[StartReply]] = collections.deque()
        self._exits: dict[int, asyncio.Future[int]] = {}
        self._lock = asyncio.Lock()
        self._tasks = [asyncio.create_task(self._read())] + [
            asyncio.create_task(pump_lines(stream, functools.partial(_template_line, name)))
            for stream, name in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
            if stream is not None
        ]

    @classmethod
    async def launch(cls, python: Path, preloads: tuple[list[str], list[str]],
                     engine_core_fork: bool, env: dict[str, str], boot_timeout_s: float,
                     fork_timeout_s: float, script: Path = TEMPLATE_SCRIPT) -> TemplateProcess:
        """Start a template and wait until it has imported (required, best-effort) modules and
        its trial child, forked at boot, has ended within fork_timeout_s."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [str(python), str(script), "--control-fd", str(theirs.fileno()),
                "--trial-fork-timeout-s", str(fork_timeout_s)]
        argv += [arg for name in preloads[0] for arg in ("--preload", name)]
        argv += [arg for name in preloads[1] for arg in ("--warm", name)]
        argv += ["--engine-core-fork"] if engine_core_fork else []
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env=env, pass_fds=(theirs.fileno(),),
                start_new_session=True,  # a terminal's Ctrl-C is the supervisor's to act on
            )
        except OSError as exc:
            ours.close()
            raise TemplateError(f"cannot start the template: {exc}") from exc
        finally:
            theirs.close()
        ours.setblocking(False)
        template = cls(proc, ours, env)
        log.info("template.starting", pid=proc.pid, preloads=len(preloads[0]) + len(preloads[1]))
        try:
            template.facts = await asyncio.wait_for(asyncio.shield(template._ready), boot_timeout_s)
        except TimeoutError:
            await template.close()
            raise TemplateError(f"not ready after {boot_timeout_s:.0f}s of imports") from None
        except (TemplateError, asyncio.CancelledError):
            await template.close()
            raise
        log.info("template.ready", **{k: v for k, v in template.facts.items() if k != "event"})
        return template

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None and not self._tasks[0].done()

    async def died(self) -> None:
        """Returns once the template process has exited."""
        await self.proc.wait()

    async def fork(self, argv: list[str], cwd: str, timeout_s: float) -> ForkedWorker:
        """One worker, forked with this argv and the template's env; TemplateError if refused.

        A worker whose reply comes too late for its caller (timed out, or cancelled) is killed
        when the reply arrives: nobody would supervise it.
        """
        async with self._lock:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            request = {"op": "start", "argv": argv, "env": self.env, "cwd": cwd}
            pending: asyncio.Future[StartReply] = asyncio.get_running_loop().create_future()
            try:
                try:
                    socket.send_fds(self._sock, [json.dumps(request).encode()], [out_w, err_w])
                finally:
                    os.close(out_w)
                    os.close(err_w)
                self._replies.append(pending)  # only a request that went out gets a reply
                message, exit_status = await asyncio.wait_for(asyncio.shield(pending), timeout_s)
            except BaseException as exc:
                pending.add_done_callback(_kill_abandoned)
                os.close(out_r)
                os.close(err_r)
                if isinstance(exc, OSError | TimeoutError | TemplateError):
                    raise TemplateError(f"no worker from the template: {exc or 'timed out'}") from exc
                raise
            if exit_status is None:
                os.close(out_r)
                os.close(err_r)
                raise TemplateError(f"the template refused: {message.get('error')}")
            pid = int(message["pid"])
            streams, transports = await _readers([(out_r, "stdout"), (err_r, "stderr")])
            log.info("worker.forked", pid=pid, template=self.proc.pid, argv=argv)
            return ForkedWorker(pid, streams, exit_status, transports)

    async def close(self) -> None:
        """End of file on the channel ends the template; SIGKILL if it does not go in time."""
        # shutdown, not close alone: the loop's pending read keeps the descriptor open until
        # it is cancelled, and the template would see no end of file meanwhile.
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        try:
            await asyncio.wait_for(self.proc.wait(), CLOSE_GRACE_S)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            await self.proc.wait()
        for task in self._tasks:
            task.cancel()

    async def _read(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while data := await loop.sock_recv(self._sock, MAX_MESSAGE_BYTES):
                self._dispatch(json.loads(data))
        except (OSError, ValueError) as exc:
            log.warning("template.channel_error", pid=self.proc.pid, error=str(exc))
        finally:
            gone = TemplateError("the template's channel closed")
            if not self._ready.done():
                self._ready.set_exception(gone)
            for pending in self._replies:
                if not pending.done():
                    pending.set_exception(gone)

    def _dispatch(self, message: dict[str, Any]) -> None:
        event = message.get("event")
        if event == "ready" and not self._ready.done():
            self._ready.set_result(message)
        elif event == "failed" and not self._ready.done():
            self._ready.set_exception(TemplateError(str(message.get("error"))))
        elif event in ("started", "refused") and self._replies:
            # Replies come in the order of the requests. The exit's future exists before any
            # later message can report that exit.
            exit_status = None
            if event == "started":
                exit_status = asyncio.get_running_loop().create_future()
                self._exits[int(message["pid"])] = exit_status
            pending = self._replies.popleft()
            if not pending.done():
                pending.set_result((message, exit_status))
        elif event == "exited" and int(message["pid"]) in self._exits:
            status = self._exits.pop(int(message["pid"]))
            if not status.done():
                status.set_result(int(message["returncode"]))
        else:
            log.warning("template.unexpected_message", message=message)


def _template_line(stream: str, line: str) -> None:
    log.info("template.output", source="template", stream=stream, line=line)


def _kill_abandoned(reply: asyncio.Future[StartReply]) -> None:
    if reply.cancelled() or reply.exception() is not None or reply.result()[1] is None:
        return
    pid = int(reply.result()[0]["pid"])
    log.warning("worker.abandoned", pid=pid, action="SIGKILL to its group")
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


async def _readers(pipes: list[tuple[int, str]]) -> tuple[list[tuple[asyncio.StreamReader, str]],
                                                          list[asyncio.BaseTransport]]:
    """asyncio readers on the read ends of the worker's stdout and stderr pipes."""
    loop = asyncio.get_running_loop()
    streams: list[tuple[asyncio.StreamReader, str]] = []
    transports: list[asyncio.BaseTransport] = []
    for fd, name in pipes:
        reader = asyncio.StreamReader()
        transport, _ = await loop.connect_read_pipe(
            functools.partial(asyncio.StreamReaderProtocol, reader), os.fdopen(fd, "rb", 0))
        streams.append((reader, name))
        transports.append(transport)
    return streams, transports


def _watch_pid(pid: int, gone: Callable[[], None]) -> int | None:
    """A pidfd that becomes readable when `pid` ends; None if it already has (or the kernel
    predates pidfds: the template's report is then the only word on the exit)."""
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    asyncio.get_running_loop().add_reader(pidfd, gone)
    return pidfd
