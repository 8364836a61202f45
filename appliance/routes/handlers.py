"""The route decorators every family uses: Litestar's, with guards given the handler itself.

Use `get` and `post` from here, not from litestar: they build appliance.fences.litestar's
`Handler`, which spares each request a copy of the handler per guard.
"""

from __future__ import annotations

from typing import Any

from litestar.enums import HttpMethod

from appliance.fences.litestar import Handler

__all__ = ["Handler", "get", "post"]


def get(path: str, **kwargs: Any) -> Handler:
    return Handler(path, http_method=HttpMethod.GET, **kwargs)


def post(path: str, **kwargs: Any) -> Handler:
    return Handler(path, http_method=HttpMethod.POST, **kwargs)
