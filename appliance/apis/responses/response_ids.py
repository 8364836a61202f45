"""Which worker stored which Responses-API answer, so that an id lost in a restart is told
apart from an id that never existed.

vLLM keeps stored responses in the worker's memory: a restart loses them, and the new worker
answers 404 for an id from before it. The appliance remembers, for the last N ids it created,
the pid of the worker that served them, and says so in its 404.
"""

from __future__ import annotations

from collections import OrderedDict

from appliance.engine import EngineView
from appliance.errors import ApiError, NotFound

_STORE_NOTE = ("Stored responses live in the engine worker's memory: they are lost when it "
               "restarts, and not kept at all for a request sent with store false.")


class ResponseIds:
    """A bounded map response id -> worker pid, oldest forgotten first."""

    def __init__(self, engine: EngineView, capacity: int) -> None:
        self._engine = engine
        self._capacity = capacity
        self._pids: OrderedDict[str, int | None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pids)

    def created(self, response_id: str) -> None:
        """A response is being made under this id by the worker serving now."""
        self._pids[response_id] = self._engine.pid
        self._pids.move_to_end(response_id)
        while len(self._pids) > self._capacity:
            self._pids.popitem(last=False)

    def explain(self, error: ApiError, response_id: str | None, param: str) -> ApiError:
        """The worker's 404 for `response_id`, saying whether a restart lost it."""
        if error.status != 404 or not response_id:
            return error
        stored_by, now = self._pids.get(response_id), self._engine.pid
        if response_id in self._pids and stored_by != now:
            return NotFound(
                f"Response '{response_id}' was stored by the engine worker pid {stored_by}, "
                f"which has restarted since (the worker now is pid {now}); it is lost. "
                + _STORE_NOTE, param=param, code="response_lost_in_restart",
                reason="response_lost_in_restart")
        return NotFound(f"{error.message} {_STORE_NOTE}", param=param, code="response_not_found",
                        reason="response_not_found")
