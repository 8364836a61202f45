"""The OpenAI error shape every refusal and failure must come in, checked one way everywhere."""

from __future__ import annotations

from typing import Any

import httpx

# OpenAI's error types, and the two the appliance has always used for its own 5xx.
ERROR_TYPES = frozenset({"invalid_request_error", "authentication_error", "permission_error",
                         "not_found_error", "rate_limit_error", "api_error", "server_error",
                         "internal_error", "service_unavailable"})


SHAPE = frozenset({"message", "type", "param", "code"})
EXTRA = frozenset({"request_id"})  # a 500 may say which id to look for in the log


def assert_openai_error(response: httpx.Response) -> dict[str, Any]:
    """{"error": {"message", "type", "param", "code"}}: a message, one of OpenAI's types, and a
    string (or null) code, not vLLM's integer one."""
    error = response.json()["error"]
    assert SHAPE <= set(error) <= SHAPE | EXTRA, error
    assert error["code"] is None or isinstance(error["code"], str), f"code {error['code']!r}"
    assert error["type"] in ERROR_TYPES, f"type {error['type']!r}"
    assert isinstance(error["message"], str) and error["message"]
    return dict(error)


def names(error: dict[str, Any], field: str) -> bool:
    """The error names `field`: in `param` (or a path under it), or in its message."""
    return str(error.get("param") or "").startswith(field) or field in str(error["message"])
