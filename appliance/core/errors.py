"""The exceptions the API answers with; appliance.answers.answer writes each one as its answer.

ApiError                         any refusal or failure a client is told about
├── BadRequest (400)             malformed body, wrong types, policy refusals naming a param
├── Unauthorized (401)
├── Forbidden (403)              a client's key does not allow the route
├── NotFound (404)
├── RequestTimeout (408)         the head or the body did not arrive within its time
├── MisdirectedRequest (421)     a Host this appliance does not answer (appliance.edge.hosts)
├── PayloadTooLarge (413)
├── HeadersTooLarge (431)        the request head's bytes or header count (the edge)
├── UnsupportedMediaType (415)   a generation request whose body is not JSON
├── Unprocessable (422)          well-formed, but not sent again (a quarantined request)
├── TooManyRequests (429)        admission; carries Retry-After
├── InternalError (500)          a bug of ours (`bug`: the exception): logged with its traceback
├── UpstreamError (the worker's status)  the worker refused or failed; its message, our shape
└── ServiceUnavailable (503)     too many connections; carries Retry-After
    └── EngineUnavailable (503)  engine not ready, restarting, lost mid-request

How an ApiError is written on the wire (OpenAI's shape, Anthropic's) is the route's choice:
see appliance.answers.shape.
"""

from __future__ import annotations


class ApiError(Exception):
    """A refusal or failure with what every error shape needs: status, kind, message, param."""

    status = 500
    kind = "server_error"  # the OpenAI `type`; shapes map it to their own vocabulary
    bug: BaseException | None = None  # the exception of ours behind an InternalError

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
        # reason: the bounded label metrics count this refusal under
        self.reason = reason or code or self.kind

    def headers(self) -> dict[str, str]:
        if self.retry_after_s is None:
            return {}
        return {"Retry-After": str(self.retry_after_s)}


class BadRequest(ApiError):
    status = 400
    kind = "invalid_request_error"


class Unauthorized(ApiError):
    status = 401
    kind = "authentication_error"


class Forbidden(ApiError):
    status = 403
    kind = "permission_error"


class NotFound(ApiError):
    status = 404
    kind = "not_found_error"


class MethodNotAllowed(ApiError):
    status = 405
    kind = "invalid_request_error"


class _BodyLeftUnread(ApiError):
    """The request's body was not read to its end: the connection cannot carry another
    request, so the answer closes it."""

    def headers(self) -> dict[str, str]:
        return super().headers() | {"Connection": "close"}


class RequestTimeout(_BodyLeftUnread):
    status = 408
    kind = "invalid_request_error"


class PayloadTooLarge(_BodyLeftUnread):
    status = 413
    kind = "invalid_request_error"


class MisdirectedRequest(ApiError):
    status = 421
    kind = "invalid_request_error"


class HeadersTooLarge(ApiError):
    status = 431
    kind = "invalid_request_error"


class UnsupportedMediaType(ApiError):
    status = 415
    kind = "invalid_request_error"


class Unprocessable(ApiError):
    """Well-formed and allowed, but this appliance will not send it (a quarantined request).
    422: the SDKs retry 408, 409, 429 and 5xx on their own, never a 422, so the answer reaches
    the caller instead of bringing the same request back."""

    status = 422
    kind = "invalid_request_error"


class TooManyRequests(ApiError):
    status = 429
    kind = "rate_limit_error"


class InternalError(ApiError):
    status = 500
    kind = "server_error"


class ServiceUnavailable(ApiError):
    status = 503
    kind = "service_unavailable"


class EngineUnavailable(ServiceUnavailable):
    pass


class UpstreamError(ApiError):
    """The worker answered with an error status; its message is passed on in our shape."""

    def __init__(self, status: int, message: str, *, param: str | None, code: str | None) -> None:
        super().__init__(message, param=param, code=code, reason=f"engine_{status}")
        self.status = status
        self.kind = _KIND_BY_STATUS.get(status, "server_error" if status >= 500
                                        else "invalid_request_error")


_KIND_BY_STATUS = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 408: "invalid_request_error", 413: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
}


def engine_unavailable(state: str, retry_after_s: int) -> EngineUnavailable:
    return EngineUnavailable(f"the engine is {state}; retry shortly", code="engine_unavailable",
                             retry_after_s=retry_after_s, reason="engine_unavailable")


def engine_lost(retry_after_s: int) -> EngineUnavailable:
    return EngineUnavailable("the engine stopped while answering this request; retry shortly",
                             code="engine_lost", retry_after_s=retry_after_s, reason="engine_lost")


def body_too_large() -> PayloadTooLarge:
    return PayloadTooLarge("request body too large (setting server.max_body_bytes)",
                           code="body_too_large", reason="body_too_large")


def body_incomplete() -> BadRequest:
    """The client's connection ended before the request's body did: nobody may be listening,
    but it is no bug of ours."""
    return BadRequest("the request body ended before it was complete (its Content-Length, "
                      "or a chunk that could not be read)", code="body_incomplete",
                      reason="body_incomplete")


def internal_error(bug: BaseException) -> InternalError:
    """A bug of ours as the client's answer; the log line (with the request id) has the rest."""
    error = InternalError("internal error; the request id is in the appliance's log",
                          code="internal_error", reason="internal_error")
    error.bug = error.__cause__ = bug
    return error
