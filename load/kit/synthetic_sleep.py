"""vLLM 0.32's sleep-mode routes for the synthetic worker, answered as vLLM answers them.

vLLM serves them only where VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/dev/sleep/
api_router.py): POST /sleep?level=&mode= (level 0 to 2, default 1; mode "abort", "wait" or
"keep", default "abort") answers {"status": "sleeping", "level": <level>}; POST /wake_up
(optional `tags` query values) {"status": "awake", "tags": <the tags, or null for all>};
GET /is_sleeping {"is_sleeping": <bool>}. A query FastAPI cannot validate is its 422 with a
`detail` list; an engine call that raises is Starlette's plain-text 500.

`fail` makes one step fail as an engine whose call raises does: "sleep" or "wake_up" answers
that 500 and changes nothing.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import parse_qs

PATHS = {"/sleep": "POST", "/wake_up": "POST", "/is_sleeping": "GET",
         "/release_kv_cache_memory": "POST"}
MODES = ("abort", "wait", "keep")
SERVER_ERROR = (500, b"Internal Server Error", b"text/plain; charset=utf-8")


class SleepRoutes:
    def __init__(self, fail: str | None = None) -> None:
        self.sleeping = False
        self.level = 0
        self.fail = fail  # "sleep" or "wake_up": that step answers a 500
        self.calls: list[str] = []  # "POST /sleep?level=1&mode=wait", in order

    def answer(self, scope: dict[str, Any]) -> tuple[int, bytes, bytes] | None:
        """(status, body, content type) for a sleep-mode route; None for any other path."""
        path, method = scope["path"], scope["method"]
        if path not in PATHS:
            return None
        query = scope.get("query_string", b"").decode()
        self.calls.append(f"{method} {path}" + (f"?{query}" if query else ""))
        if method != PATHS[path]:
            return _json(405, {"detail": "Method Not Allowed"})
        params = parse_qs(query)
        if path == "/is_sleeping":
            return _json(200, {"is_sleeping": self.sleeping})
        if path == "/release_kv_cache_memory":
            return _json(200, {"status": "kv_cache_released"})
        if path == "/sleep":
            return self._sleep(params)
        if self.fail == "wake_up":
            return SERVER_ERROR
        self.sleeping, self.level = False, 0
        return _json(200, {"status": "awake", "tags": params.get("tags") or None})

    def _sleep(self, params: dict[str, list[str]]) -> tuple[int, bytes, bytes]:
        level, mode = params.get("level", ["1"])[-1], params.get("mode", ["abort"])[-1]
        if not level.lstrip("-").isdigit():
            return _invalid("int_parsing", "level", level, "Input should be a valid integer, "
                            "unable to parse string as an integer", None)
        if not 0 <= int(level) <= 2:
            bound = ("greater_than_equal", "greater than or equal to 0", {"ge": 0}) \
                if int(level) < 0 else ("less_than_equal", "less than or equal to 2", {"le": 2})
            return _invalid(bound[0], "level", level, f"Input should be {bound[1]}", bound[2])
        if mode not in MODES:
            expected = "'abort', 'wait' or 'keep'"
            return _invalid("literal_error", "mode", mode, f"Input should be {expected}",
                            {"expected": expected})
        if self.fail == "sleep":
            return SERVER_ERROR
        self.sleeping, self.level = True, int(level)
        return _json(200, {"status": "sleeping", "level": int(level)})


def _json(status: int, payload: object) -> tuple[int, bytes, bytes]:
    return status, json.dumps(payload).encode(), b"application/json"


def _invalid(kind: str, name: str, value: str, message: str,
             ctx: dict[str, object] | None) -> tuple[int, bytes, bytes]:
    """FastAPI's 422 for a query parameter pydantic refused."""
    error: dict[str, object] = {"type": kind, "loc": ["query", name], "msg": message,
                                "input": value}
    return _json(422, {"detail": [error | ({"ctx": ctx} if ctx else {})]})
