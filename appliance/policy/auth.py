"""API-key authentication against the configured keys, in constant time."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from appliance.core.errors import Unauthorized


def match_key(authorization: str | None, digests: Sequence[bytes], *,
              x_api_key: str | None = None) -> int:
    """The index of the SHA-256 digest `Bearer <key>` matches; Unauthorized if none does.

    Every digest is compared whatever the earlier ones gave, and on digests, so that neither
    which key matched nor a key's length shows in the timing. Where the route's protocol
    sends its key in an `x-api-key` header (Anthropic's), pass that header's value as
    `x_api_key`: the Bearer token wins when both are sent.
    """
    token = _bearer_token(authorization) or (x_api_key or "").strip()
    if not token:
        how = "'Authorization: Bearer <key>'" + (" or 'x-api-key: <key>'"
                                                  if x_api_key is not None else "")
        raise Unauthorized(f"Missing API key: send {how}.", code="invalid_api_key")
    presented = digest(token)
    found = -1
    for index, candidate in enumerate(digests):
        # No short-circuit: the loop runs to its end whatever matched.
        if hmac.compare_digest(presented, candidate) and found < 0:
            found = index
    if found < 0:
        raise Unauthorized("Invalid API key.", code="invalid_api_key")
    return found


def _bearer_token(authorization: str | None) -> str:
    scheme, _, token = (authorization or "").strip().partition(" ")
    return token.strip() if scheme.lower() == "bearer" else ""


def digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()
