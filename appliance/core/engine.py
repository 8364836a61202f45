"""What the API may know of the engine: a small read-only view the supervisor implements."""

from __future__ import annotations

import enum
import hashlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from appliance.core.errors import ApiError


class EngineState(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    UNHEALTHY = "unhealthy"
    DRAINING = "draining"
    STOPPING = "stopping"
    BACKOFF = "backoff"
    FAILED = "failed"
    STOPPED = "stopped"
    UNLOADED = "unloaded"  # residency stopped its worker; a request for it loads it again
    SLEEPING = "sleeping"  # residency put its worker to sleep; a request for it wakes it


class Pending(Protocol):
    """What the supervisor may learn of one request waiting on the worker (an
    appliance.proxy.outbound.Outbound)."""

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
    at_death: bool = False  # an engine death was described while this worker had it


_Unhashed = tuple[Pending, bytes]  # a request and its body as first sent


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
        # Those whose exchange failed while the relay asks whether the worker died (checking).
        self._checking: dict[object, _Held] = {}
        # Each request's name, fixed at its first send: its fingerprint, or until one is asked
        # for (a death, a quarantine with suspects) what it is hashed from.
        self._named: dict[object, str | _Unhashed] = {}
        self._cut: deque[tuple[_Held, str | _Unhashed | None, int]] = deque(maxlen=cut_kept)
        self.sent = 0  # requests added so far: a new one is work the engine has not seen
        # Told the fingerprint of each request answered in full by a worker that had it
        # through no death, where it was hashed (it met a death or a suspect): the quarantine.
        self.answered: list[Callable[[str], None]] = []

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
        self._checking.pop(key, None)
        self._named.pop(key, None)

    def set_aside(self, key: object) -> None:
        """No worker has the request for now (it waits for the next one, to be added again):
        not work a worker owes, nor in flight at a death; its fingerprint is kept."""
        self._requests.pop(key, None)
        self._checking.pop(key, None)

    def checking(self, key: object) -> None:
        """The request's exchange failed and the relay asks whether the worker died. Until it
        knows, the request is not work the engine owes: a client's words in a stream, or a
        connection vLLM dropped, must never look like an engine that stopped working. It is
        still in flight if the worker did die (described at the death)."""
        held = self._requests.pop(key, None)
        if held is not None:
            self._checking[key] = held

    def checked(self, key: object) -> None:
        """The relay could not tell: the request waits on the worker again, as before."""
        held = self._checking.pop(key, None)
        if held is not None:
            self._requests[key] = held

    def holding(self, key: object, request_id: str, pending: Pending) -> Holding:
        """The request waits on the worker until the returned Holding is left (a context
        manager); one that leaves it on an error of 500 or above (the worker unreachable, its
        own 5xx) is kept as failed."""
        self.add(key, request_id, pending)
        return Holding(self, key)

    def left(self, key: object, error: BaseException | None) -> None:
        """The request no longer waits (Holding's exit), on `error` or answered in full."""
        held = self._requests.get(key)
        if held is not None:
            if error is None:
                while self._cut and self._cut[0][2] <= held.serial:
                    self._cut.popleft()
                named = self._named.get(key)
                if isinstance(named, str) and not held.at_death:
                    for listener in self.answered:
                        listener(named)
            # One set aside when it failed was already told at the death that failed it.
            elif isinstance(error, ApiError) and error.status >= 500:
                self._cut.append((held, self._named.get(key), self.sent))
        self.discard(key)

    def name(self, key: object, body: bytes | None) -> None:
        """Fixes the request's name at its first send (`body` as sent then): a request sent
        again with a changed body (a resumed stream) keeps it. Nothing is hashed until the
        fingerprint is asked for: most requests never meet a death or a suspect."""
        if key not in self._named:
            self._named[key] = (self._requests[key].pending, body or b"")

    def fingerprint(self, key: object, body: bytes | None) -> str:
        """The request's fingerprint, as named by its first send (`name`, or this call)."""
        self.name(key, body)
        named = self._named[key]
        if not isinstance(named, str):
            named = self._named[key] = _hashed(named)
        return named

    def __len__(self) -> int:
        return len(self._requests)

    def describe(self, bodies: bool = False) -> list[dict[str, Any]]:
        """What an engine had at its death: each request waiting on it, and each it failed
        since the last death (`failed`: those are told once), with its id, fingerprint (as
        fixed at its first send, or of its body now if it was not sent yet), route, client and
        size; its body only if asked."""
        held = [(h, self._named.get(key), False)
                for key, h in [*self._requests.items(), *self._checking.items()]]
        for h, _, _ in held:
            h.at_death = True  # its answer, if it ends, came from a worker that died with it
        held += [(h, named, True) for h, named, _ in self._cut]
        self._cut.clear()
        return [_described(h, named, failed, bodies) for h, named, failed in held]


class Holding:
    """A request held in Waiting for the block's length (Waiting.holding)."""

    __slots__ = ("_key", "_waiting")

    def __init__(self, waiting: Waiting, key: object) -> None:
        self._waiting, self._key = waiting, key

    def __enter__(self) -> None:
        return None

    def __exit__(self, _kind: object, error: BaseException | None, _tb: object) -> None:
        self._waiting.left(self._key, error)


def _hashed(named: _Unhashed) -> str:
    pending, body = named
    return fingerprint(pending.target, pending.client_name, body)


def _described(held: _Held, named: str | _Unhashed | None, failed: bool,
               bodies: bool) -> dict[str, Any]:
    pending = held.pending
    client, raw = pending.client_name, pending.body() or b""
    if named is None:  # not sent yet: named by its body as it stands
        named = fingerprint(pending.target, client, raw)
    entry: dict[str, Any] = {
        "request_id": held.request_id, "route": pending.target, "client": client,
        "fingerprint": named if isinstance(named, str) else _hashed(named),
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

    async def answers(self, serial: int) -> bool:
        """Whether the worker numbered `serial` still serves and answers its health probe now
        (vLLM's /health fails once its engine core is dead)."""
        ...

    def snapshot(self) -> dict[str, Any]:
        """Health detail: state, pid, uptime, restarts, last exit cause, GPU summary."""
        ...



class Residency(Protocol):
    """Which models have a worker loaded (supervisor.engine.residency); absent where every
    model of the catalog stays loaded."""

    async def acquire(self, model: str) -> Callable[[], None]:
        """Waits until `model`'s worker serves (loading it, and unloading an idle model for
        it, if need be); returns the release to call when the request ends. Raises an ApiError
        (429 or 503, with Retry-After) where it cannot be served in time."""
        ...

    def snapshot(self, model: str) -> dict[str, object]:
        """The model's residency: loaded, in use, queued, idle time, swaps and unloads."""
        ...
