"""What the API may know of the engine: a small read-only view the supervisor implements."""

from __future__ import annotations

import contextlib
import enum
import hashlib
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.errors import ApiError


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"


class Pending(Protocol):
    """What the supervisor may learn of one request waiting on the worker (an
    appliance.outbound.Outbound)."""

    @property
    def target(self) -> str: ...

    @property
    def stream(self) -> bool: ...

    @property
    def client_name(self) -> str: ...

    def body(self) -> bytes | None: ...


@dataclass
class _Held:
    request_id: str
    pending: Pending
    serial: int  # the count of requests sent when it was added
    answering: bool = False  # a byte of its answer came from this worker


class Waiting:
    """The appliance's own requests waiting on the worker: sent (or being fitted with the
    worker's /tokenize) and not yet answered in full. Work the engine owes, known here even when
    the worker's own gauges froze with it. The relay holds each request here while the worker
    has it (one dict insert and delete); the supervisor reads the count each second and
    describes the requests only when an engine dies.

    A crashing worker fails its requests (a 5xx, a dropped connection) a moment before its exit
    is seen, and those relays end first: a request the engine failed is kept (at most
    `cut_kept`, policy.max_inflight in serve) and described at the next death, unless a request
    sent after it is answered in full first, which proves the engine outlived the failure."""

    def __init__(self, cut_kept: int = 64) -> None:
        self._requests: dict[object, _Held] = {}
        self._named: dict[object, str] = {}  # fingerprints fixed at each request's first send
        self._cut: deque[tuple[_Held, str | None, int]] = deque(maxlen=cut_kept)
        self.sent = 0  # requests added so far: a new one is work the engine has not seen

    def add(self, key: object, request_id: str, pending: Pending) -> None:
        self._requests[key] = _Held(request_id, pending, self.sent)
        self.sent += 1

    def answering(self, key: object) -> None:
        """The first byte of the request's answer came: the worker has taken it up."""
        held = self._requests.get(key)
        if held is not None:
            held.answering = True

    def unanswered(self) -> int:
        """Requests with no byte of their answer yet: work the engine owes whatever its gauges
        say (read once a second by the supervisor)."""
        return sum(not held.answering for held in self._requests.values())

    def discard(self, key: object) -> None:
        self._requests.pop(key, None)
        self._named.pop(key, None)

    def set_aside(self, key: object) -> None:
        """No worker has the request for now (it waits for the next one, to be added again):
        not work a worker owes, nor in flight at a death; its fingerprint is kept."""
        self._requests.pop(key, None)

    @contextlib.contextmanager
    def holding(self, key: object, request_id: str, pending: Pending) -> Iterator[None]:
        """The request waits on the worker for the block's length; one that leaves it on an
        error of 500 or above (the worker unreachable, its own 5xx) is kept as failed."""
        self.add(key, request_id, pending)
        try:
            yield
        except ApiError as error:
            # One set aside when it failed was already told at the death that failed it.
            if error.status >= 500 and (held := self._requests.get(key)) is not None:
                self._cut.append((held, self._named.get(key), self.sent))
            raise
        else:
            if (held := self._requests.get(key)) is not None:
                while self._cut and self._cut[0][2] <= held.serial:
                    self._cut.popleft()
        finally:
            self.discard(key)

    def fingerprint(self, key: object, body: bytes | None) -> str:
        """The request's fingerprint, fixed by the first call (its first send, `body` as sent
        then): a request sent again with a changed body (a resumed stream) keeps its name."""
        named = self._named.get(key)
        if named is None:
            pending = self._requests[key].pending
            named = self._named[key] = fingerprint(pending.target, pending.client_name,
                                                   body or b"")
        return named

    def __len__(self) -> int:
        return len(self._requests)

    def describe(self, bodies: bool = False) -> list[dict[str, Any]]:
        """What an engine had at its death: each request waiting on it, and each it failed
        since the last death (`failed`: those are told once), with its id, fingerprint (as
        fixed at its first send, or of its body now if it was not sent yet), route, client and
        size; its body only if asked."""
        held = [(h, self._named.get(key), False) for key, h in list(self._requests.items())]
        held += [(h, named, True) for h, named, _ in self._cut]
        self._cut.clear()
        return [_described(h, named, failed, bodies) for h, named, failed in held]


def _described(held: _Held, named: str | None, failed: bool, bodies: bool) -> dict[str, Any]:
    pending = held.pending
    client, raw = pending.client_name, pending.body() or b""
    entry: dict[str, Any] = {
        "request_id": held.request_id, "route": pending.target, "client": client,
        "fingerprint": named or fingerprint(pending.target, client, raw),
        "body_bytes": len(raw), "stream": pending.stream, "failed": failed}
    if bodies:
        entry["body"] = raw.decode("utf-8", "replace")
    return entry


def fingerprint(route: str, client: str, body: bytes) -> str:
    """Names one request by route, client and body, without keeping the body."""
    digest = hashlib.sha256(route.encode() + b"\0" + client.encode() + b"\0" + body)
    return digest.hexdigest()[:16]


class EngineView(Protocol):
    """The engine as the API sees it; implemented by supervisor.engine.manager.EngineManager."""

    @property
    def state(self) -> EngineState: ...

    @property
    def pid(self) -> int | None: ...

    @property
    def base_url(self) -> str: ...

    @property
    def model_name(self) -> str: ...

    @property
    def waiting(self) -> Waiting:
        """Where the relay counts its requests waiting on the worker."""
        ...

    def retry_after_s(self) -> int:
        """How long a client should wait before trying again while the engine is not ready."""
        ...

    @property
    def serial(self) -> int:
        """Counts the workers started: a new one serving after a fault has a higher number."""
        ...

    @property
    def stop_requested(self) -> bool:
        """The supervisor is stopping: no worker will be started again."""
        ...

    def on_lost(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` once if the current worker stops serving (crash, hang, stop);
        returns the function that cancels the subscription."""
        ...

    async def changed(self, timeout_s: float) -> None:
        """Returns at the engine's next change of state, or after `timeout_s`."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Health detail: state, pid, uptime, restarts, last exit cause, GPU summary."""
        ...

