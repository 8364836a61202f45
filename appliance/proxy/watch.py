"""The watch over one request: cancels its owner when the client goes, the engine is lost or the
cost watch finds the request too costly, and says which.

Where the request may outlive the engine (resume), a loss breaks the exchange under way instead
(`exchange`): its reader hears it as the engine's fault and sends the request on to the next
worker. The watch acts on that exchange, never on its owner.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from litestar.types import Receive

from appliance.core.engine import EngineView
from appliance.core.upstream import Reply
from appliance.fences.uvicorn import ClientLink


class Watch:
    """Entered by the task that owns the request; cancels that task when it must stop.

    The client's connection tells through its ClientLink where the server gives one; under
    any other ASGI server a task waits in `receive()` for the disconnect."""

    def __init__(self, receive: Receive, engine: EngineView, link: ClientLink | None,
                 *, breaks_exchange: bool = False) -> None:
        self._receive = receive
        self._engine = engine
        self._link = link
        self._breaks_exchange = breaks_exchange
        self.reason: str | None = None
        # The worker's answer being read: what an engine loss breaks (where it may be outlived),
        # and whose completeness tells the pump that what it holds is the last of the answer.
        self.exchange: Reply | None = None
        self._armed = False
        self._forget_client: Callable[[], object] = _nothing
        self._forget_engine: Callable[[], object] = _nothing

    def __enter__(self) -> Watch:
        task = asyncio.current_task()
        assert task is not None
        self._task = task
        self._armed = True
        if self._link is not None:
            self._forget_client = self._link.on_gone(self._client_gone)
        else:
            self._forget_client = asyncio.ensure_future(self._listen()).cancel
        self._forget_engine = self._engine.on_lost(self._engine_lost)
        return self

    def __exit__(self, *_: object) -> None:
        self.disarm()
        self._forget_client()
        self._forget_engine()
        self.exchange = None

    def disarm(self) -> None:
        """No cancellation from here on: the answer is complete or being completed."""
        self._armed = False

    def follow_engine(self) -> None:
        """Watch the worker now serving (a loss is told once per worker)."""
        self._forget_engine()
        self._forget_engine = self._engine.on_lost(self._engine_lost)

    def too_costly(self) -> None:
        self._fire("too_costly")

    async def _listen(self) -> None:
        while (await self._receive())["type"] != "http.disconnect":
            pass
        self._client_gone()

    def _client_gone(self) -> None:
        self._fire("client_disconnected")

    def _engine_lost(self) -> None:
        if self._breaks_exchange and self._armed:
            if self.exchange is not None:
                self.exchange.abort()  # its reader fails where it reads, and recovers
            return
        self._fire("engine_lost")

    def _fire(self, reason: str) -> None:
        if self._armed and self.reason is None:
            self.reason = reason
            self._task.cancel()


def _nothing() -> None:
    pass
