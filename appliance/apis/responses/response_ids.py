"""Whose stored Responses-API answer each id names, and which worker stored it.

vLLM keeps stored responses in the worker's memory, under the id the request's `request_id`
gave, for anyone who names it: it knows no clients. So the appliance remembers, for each
client's last N ids, the client that made each one and the worker that served it. An id is
reached (retrieved, cancelled, continued with `previous_response_id`) only by its own client:
for anyone else, and for an id the appliance does not know, the answer is the same 404, without
asking the worker. An id another client's response has cannot be chosen again. A worker's 404
for an id the appliance knows says whether a restart lost it.

An id is recorded only once its request is admitted (a refused request leaves no trace), and
each client's ids are bounded on their own: a client making many responses forgets its own
oldest, never another client's. Client names are bounded by the configuration (named clients
and the one anonymous client), so the map is too.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from appliance.core.engine import EngineView
from appliance.core.errors import ApiError, BadRequest, NotFound

_STORE_NOTE = ("Stored responses live in the engine worker's memory: they are lost when it "
               "restarts, and not kept at all for a request sent with store false.")


@dataclass(frozen=True)
class _Made:
    owner: str  # the client's name
    engine: EngineView  # the model's engine that served it (each model its own worker)
    pid: int | None  # the worker that served it


class ResponseIds:
    """Response id -> (client, worker pid), at most `capacity` ids per client, each client's
    oldest forgotten first."""

    def __init__(self, engine: EngineView, capacity: int) -> None:
        self._engine = engine
        self._capacity = capacity
        self._made: dict[str, _Made] = {}
        self._owned: dict[str, OrderedDict[str, None]] = {}  # client -> its ids, oldest first

    def __len__(self) -> int:
        return len(self._made)

    def claim(self, response_id: str, owner: str) -> None:
        """Refused (400) when another client's response has the id; records nothing."""
        made = self._made.get(response_id)
        if made is not None and made.owner != owner:
            raise BadRequest("'request_id' names a response that is not yours; leave it out and "
                             "the appliance names the response.", param="request_id",
                             code="request_id_taken", reason="request_id_taken")

    def created(self, response_id: str, owner: str, *, stored: bool,
                engine: EngineView | None = None) -> None:
        """`owner`'s admitted request makes a response under this id, with the worker serving
        now (claimed again: another client may have taken the id while this one waited);
        `engine`: the engine of the model it went to (None: the default model's)."""
        self.claim(response_id, owner)
        if not stored:
            return
        engine = engine or self._engine
        self._made[response_id] = _Made(owner, engine, engine.pid)
        owned = self._owned.setdefault(owner, OrderedDict())
        owned[response_id] = None
        owned.move_to_end(response_id)
        while len(owned) > self._capacity:
            forgotten, _ = owned.popitem(last=False)
            del self._made[forgotten]

    def reach(self, response_id: str, owner: str, param: str) -> None:
        """Raises the unknown id's 404 unless `owner` made the response."""
        made = self._made.get(response_id)
        if made is None or made.owner != owner:
            raise _not_found(response_id, param)

    def engine_of(self, response_id: str) -> EngineView | None:
        """The engine that stored the response (its model's), if the id is known."""
        made = self._made.get(response_id)
        return made.engine if made is not None else None

    def explain(self, error: ApiError, response_id: str | None, param: str) -> ApiError:
        """The worker's 404 for `response_id`, saying whether a restart lost it."""
        if error.status != 404 or not response_id:
            return error
        made = self._made.get(response_id)
        now = made.engine.pid if made is not None else self._engine.pid
        if made is not None and made.pid != now:
            return NotFound(
                f"Response '{response_id}' was stored by the engine worker pid {made.pid}, "
                f"which has restarted since (the worker now is pid {now}); it is lost. "
                + _STORE_NOTE, param=param, code="response_lost_in_restart",
                reason="response_lost_in_restart")
        return _not_found(response_id, param)


def _not_found(response_id: str, param: str) -> NotFound:
    """One answer for an id that is not there and for one that is not the caller's."""
    return NotFound(f"Response with id '{response_id}' not found. {_STORE_NOTE}", param=param,
                    code="response_not_found", reason="response_not_found")
