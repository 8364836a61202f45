"""Which way a worker starts: forked from the template when it can serve, else spawned."""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import structlog

from appliance.core.sections import EngineSettings
from appliance.fences.vllm import API_PRELOADS, API_WARM, CPU_ENGINE_WARM
from supervisor.engine.listen import listen_released
from supervisor.engine.worker import ProcessLauncher, SessionWorker, build_command, build_env
from supervisor.template.process import (
    MAX_TEMPLATE_FAILURES,
    TEMPLATE_SCRIPT,
    TemplateError,
    TemplateProcess,
)

log = structlog.get_logger("supervisor.engine.launcher")


def build_launcher(engine: EngineSettings,
                   media_hosts: list[str] | None = None) -> TemplateLauncher | ProcessLauncher:
    """The template launcher where it applies (vLLM started from the engine venv), else spawn."""
    if engine.template == "off":
        log.info("worker.template_off", reason="engine.template is off")
        return ProcessLauncher(engine, media_hosts)
    if engine.command is not None:
        log.info("worker.template_off", reason="engine.command replaces vLLM")
        return ProcessLauncher(engine, media_hosts)
    return TemplateLauncher(engine, media_hosts)


def venv_fingerprint(paths: list[Path]) -> tuple[int, ...]:
    """Modification times of the interpreter link, its target and site-packages: an install or
    upgrade in the engine venv changes one of them (site-packages gains and loses entries)."""
    stamps = []
    for path in paths:
        for follow in (False, True):
            try:
                stamps.append(path.stat(follow_symlinks=follow).st_mtime_ns)
            except OSError:
                stamps.append(-1)
    return tuple(stamps)


class TemplateLauncher:
    """Forks workers from a template kept ready; spawns (and says why) when it cannot."""

    def __init__(self, engine: EngineSettings, media_hosts: list[str] | None = None, *,
                 script: Path = TEMPLATE_SCRIPT, preloads: list[str] | None = None) -> None:
        self._engine = engine
        self._media_hosts = media_hosts
        self._spawn = ProcessLauncher(engine, media_hosts)
        self._script = script
        cpu = engine.resolved_device() == "cpu"
        warm = API_WARM + (CPU_ENGINE_WARM if cpu else ())
        self._preloads = (list(API_PRELOADS), list(warm)) if preloads is None else (preloads, [])
        self._engine_core_fork = preloads is None
        self._template: TemplateProcess | None = None
        self._booting: asyncio.Task[TemplateProcess] | None = None
        self._watcher: asyncio.Task[None] | None = None
        self._fingerprint: tuple[int, ...] = ()
        self._failures = 0
        self._last_boot_failed = False
        self._last_failure = ""
        self._disabled: str | None = None

    @property
    def template(self) -> TemplateProcess | None:
        return self._template

    async def start(self) -> SessionWorker:
        reason = await self._ready_template()
        if self._template is not None and reason is None:
            await listen_released(self._engine)
            try:
                argv = self._engine.command or build_command(self._engine, self._media_hosts)
                worker = await self._template.fork(argv, os.getcwd(),
                                                   self._engine.template_fork_timeout_s)
            except TemplateError as exc:
                reason = str(exc)
                self._note_failure(reason)
                await self._retire("fork failed")
            else:
                self._failures = 0
                return worker
        log.warning("worker.spawn_fallback", reason=reason)
        return await self._spawn.start()

    async def aclose(self) -> None:
        self._disabled = "closing"
        await self._retire("closing")

    # --- the template's life ------------------------------------------------------------------

    async def _ready_template(self) -> str | None:
        """None once a template is ready for this start, else why the worker must be spawned."""
        if self._disabled is not None:
            return self._disabled
        template = self._template
        if template is not None:
            stale = ("template died" if not template.alive else
                     "engine venv changed" if self._venv_changed() else
                     "worker environment changed" if template.env != build_env(self._engine) else None)
            if stale is not None:
                await self._retire(stale)
        if self._template is None and self._booting is None:
            self._boot()
        if self._template is None and self._booting is not None:
            if self._last_boot_failed:  # don't make a restart wait on a template that may fail
                return f"template not ready; the last one failed: {self._last_failure}"
            with contextlib.suppress(TemplateError):
                await asyncio.shield(self._booting)
        if self._template is not None:
            return None
        return self._disabled or f"template unavailable: {self._last_failure}"

    def _boot(self) -> None:
        env = build_env(self._engine)
        self._booting = asyncio.create_task(TemplateProcess.launch(
            Path(self._engine.python), self._preloads, self._engine_core_fork, env,
            self._engine.template_boot_timeout_s, self._engine.template_fork_timeout_s,
            self._script))
        self._booting.add_done_callback(self._booted)

    def _booted(self, task: asyncio.Task[TemplateProcess]) -> None:
        self._booting = None
        if task.cancelled():
            return
        exc = task.exception()
        if exc is not None:
            self._last_boot_failed = True
            self._note_failure(str(exc))
            return
        self._last_boot_failed = False
        self._template = task.result()
        self._fingerprint = venv_fingerprint(self._watched_paths(self._template))
        self._watcher = asyncio.create_task(self._watch(self._template))

    async def _watch(self, template: TemplateProcess) -> None:
        """A template that dies on its own is replaced at once, so the next restart is warm."""
        await template.died()
        if template is not self._template:
            return  # retired on purpose
        self._template = None
        log.warning("template.exited", pid=template.proc.pid, returncode=template.proc.returncode)
        self._note_failure(f"template exited {template.proc.returncode}")
        await template.close()
        if self._disabled is None and self._booting is None:
            self._boot()

    async def _retire(self, reason: str) -> None:
        template, self._template = self._template, None
        if self._booting is not None:
            self._booting.cancel()
            self._booting = None
        if template is not None:
            log.info("template.retired", pid=template.proc.pid, reason=reason)
            await template.close()

    def _note_failure(self, reason: str) -> None:
        self._failures += 1
        self._last_failure = reason
        log.warning("template.failed", reason=reason, failures=self._failures)
        if self._failures >= MAX_TEMPLATE_FAILURES and self._disabled is None:
            self._disabled = f"template gave up after {self._failures} failures: {reason}"
            log.error("template.disabled", reason=self._disabled)

    def _venv_changed(self) -> bool:
        assert self._template is not None
        return venv_fingerprint(self._watched_paths(self._template)) != self._fingerprint

    def _watched_paths(self, template: TemplateProcess) -> list[Path]:
        sites = template.facts.get("site_packages", [])
        return [Path(self._engine.python), *(Path(p) for p in sites)]
