"""The one error shape the API answers with, and the exceptions that map onto it.

ApiError                      any answer in the OpenAI error shape
├── BadRequest (400)          malformed body, wrong types, policy refusals naming a param
├── Unauthorized (401)
├── PayloadTooLarge (413)
├── TooManyRequests (429)     admission; carries Retry-After
└── EngineUnavailable (503)   engine not ready, restarting, lost mid-request; carries Retry-After
"""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    """An answer in the OpenAI shape {"error": {"message", "type", "param", "code"}}."""

    status = 500
    type = "internal_error"

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
        reason: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s
        # reason: the label metrics count this rejection under
        self.reason = reason or code or self.type

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}


class BadRequest(ApiError):
    status = 400
    type = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    type = "authentication_error"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"


class PayloadTooLarge(ApiError):
    status = 413
    type = "invalid_request_error"


class TooManyRequests(ApiError):
    status = 429
    type = "rate_limit_error"


class EngineUnavailable(ApiError):
    status = 503
    type = "service_unavailable"


def error_body(
    message: str, type_: str, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
