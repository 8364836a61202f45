"""An in-process fake engine view and real local servers (synthetic upstream, the app)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import uvicorn
from prometheus_client import CollectorRegistry

from appliance.app import create_app
from appliance.core.engine import EngineState, Waiting
from appliance.core.settings import Settings
from appliance.edge.limits import EdgeMetrics, edge_protocol
from load.kit.net import free_port
from load.kit.synthetic_worker import SyntheticWorker


@dataclass
class FakeEngine:
    """EngineView with settable state; counts what the proxy reports."""

    base_url: str
    state: EngineState = EngineState.READY
    pid: int | None = 4242
    model_name: str = "synthetic"
    _lost: dict[int, Callable[[], None]] = field(default_factory=dict)
    waiting: Waiting = field(default_factory=Waiting)
    serial: int = 1  # the worker serving
    stop_requested: bool = False
    healthy: bool = True  # what its health probe answers while it serves
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    def retry_after_s(self) -> int:
        return 7

    async def changed(self, timeout_s: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_s):
                await self._changed.wait()

    def set_state(self, state: EngineState, serial: int | None = None) -> None:
        """A change of state (and of worker) as the manager makes it."""
        self.state = state
        self.serial = self.serial if serial is None else serial
        self._changed.set()
        self._changed = asyncio.Event()

    async def answers(self, serial: int) -> bool:
        """A worker that still serves answers its probe (set `healthy` False to say it does not)."""
        return self.healthy and serial == self.serial and self.state is EngineState.READY

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        key = id(callback)
        self._lost[key] = callback
        return lambda: self._lost.pop(key, None) and None

    def fire_lost(self) -> None:
        """What the manager does when the worker is declared dead: its subscribers told, then
        the state it stops in."""
        callbacks, self._lost = list(self._lost.values()), {}
        for callback in callbacks:
            callback()
        self.set_state(EngineState.STOPPING)

    @property
    def watchers(self) -> int:
        return len(self._lost)

    def snapshot(self) -> dict[str, Any]:
        return {"state": self.state.value, "pid": self.pid, "restarts": 0,
                "gpu": {"status": "unavailable"}}


@dataclass
class FakeReading:
    """The worker's own counters as the supervisor last read them (appliance.recent)."""

    running: float = 0.0
    waiting: float = 0.0
    generation_tokens: float = 0.0


@contextlib.asynccontextmanager
async def serving(app: Any, port: int, settings: Settings | None = None
                  ) -> AsyncIterator[uvicorn.Server]:
    """`app` on a real socket; with `settings`, behind the edge protocol serve runs it with."""
    http: Any = "auto" if settings is None else edge_protocol(
        settings.server, EdgeMetrics(CollectorRegistry()))
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None,
                                           access_log=False, lifespan="on", http=http))
    task = asyncio.create_task(server.serve())
    while not server.started:
        assert not task.done(), "server failed to start"
        await asyncio.sleep(0.01)
    try:
        yield server
    finally:
        server.should_exit = True
        await task


@contextlib.asynccontextmanager
async def upstream(tokens: int = 8, delay: float = 0.0) -> AsyncIterator[tuple[SyntheticWorker, str]]:
    port = free_port()
    fake = SyntheticWorker(tokens, delay, "synthetic")
    async with serving(fake, port):
        yield fake, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def appliance(engine: FakeEngine, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    """The real app over a real socket in front of `engine`, and a client for it."""
    port, config = free_port(), Settings(**settings)
    async with serving(create_app(config, engine), port, config), httpx.AsyncClient(
        base_url=f"http://127.0.0.1:{port}", timeout=10
    ) as client:
        yield client


async def eventually(condition: Callable[[], bool], within_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not condition():
        assert loop.time() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def stream_until_lost(client: httpx.AsyncClient, engine: FakeEngine, path: str,
                            body: dict[str, Any], after_lines: int) -> list[str]:
    """Streams `body` to `path`, declares the engine lost once `after_lines` non-empty lines
    arrived, and returns every non-empty line up to the stream's own end."""
    lines: list[str] = []
    async with client.stream("POST", path, json=body) as response:
        async for line in response.aiter_lines():
            if line:
                lines.append(line)
            if len(lines) == after_lines:
                engine.fire_lost()
    return lines

