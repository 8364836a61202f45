"""API-key authentication against the configured keys, in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from appliance.errors import Unauthorized


def check_bearer(authorization: str | None, keys: Sequence[str], *,
                 x_api_key: str | None = None) -> None:
    """Unauthorized (code invalid_api_key) unless `Bearer <key>` names one of `keys`.

    No keys configured means the API is open. Every key is compared, on SHA-256 digests so
    that neither which key matched nor a key's length shows in the timing. No message ever
    contains a key, configured or presented. Where the route's protocol sends its key in an
    `x-api-key` header (Anthropic's), pass that header's value as `x_api_key`: the Bearer
    token wins when both are sent.
    """
    if not keys:
        return
    token = _bearer_token(authorization) or (x_api_key or "").strip()
    if not token:
        how = "'Authorization: Bearer <key>'" + (" or 'x-api-key: <key>'"
                                                  if x_api_key is not None else "")
        raise Unauthorized(f"Missing API key: send {how}.", code="invalid_api_key")
    presented = _digest(token)
    matched = False
    for key in keys:
        # No short-circuit: every key is compared whatever the earlier ones gave.
        matched |= bool(key) and hmac.compare_digest(presented, _digest(key))
    if not matched:
        raise Unauthorized("Invalid API key.", code="invalid_api_key")


def _bearer_token(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
