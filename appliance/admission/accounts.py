"""What each client holds at the door: sequences open, and a token bucket for tokens per minute."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from appliance.admission.clients import Client
from appliance.core.errors import TooManyRequests


class TokenBucket:
    """`per_minute` tokens that refill continuously. A request is let in while the level is
    above zero; its usage is charged once known and may take the level below zero (a debt
    the refill pays before the next request)."""

    def __init__(self, per_minute: int, now: float) -> None:
        self.per_minute = per_minute
        self.level = float(per_minute)
        self._stamp = now

    def charge(self, tokens: int, now: float) -> None:
        self._refill(now)
        self.level -= tokens

    def empty_for(self, now: float) -> float:
        """Seconds until the level is above zero again; 0 when it is now."""
        self._refill(now)
        return 0.0 if self.level > 0 else (1 - self.level) * 60 / self.per_minute

    def _refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self._stamp) * self.per_minute / 60)
        self._stamp = now


@dataclass
class Account:
    """One client's requests held (queued or admitted) and its bucket, kept across reloads."""

    held: int = 0  # sequences (a request's fan-out), queued or admitted
    bucket: TokenBucket | None = field(default=None)

    def check(self, client: Client, now: float, mean_hold_s: float, sequences: int = 1) -> None:
        """429 naming the client's limit it is over, and when it resets (Retry-After):
        `sequences` more would hold more than its max_inflight."""
        if client.max_inflight is not None and self.held + sequences > client.max_inflight:
            raise _limited(f"client '{client.name}' has {self.held} sequences open and asks "
                           f"{sequences} more, over its limit "
                           f"(max_inflight {client.max_inflight}); one should finish in about "
                           f"{_seconds(mean_hold_s)} s", "client_max_inflight", mean_hold_s)
        bucket = self._bucket(client, now)
        if bucket is not None and (wait := bucket.empty_for(now)) > 0:
            raise _limited(f"client '{client.name}' used its {client.tokens_per_minute} tokens "
                           f"per minute (limit tokens_per_minute); it resets in "
                           f"{_seconds(wait)} s", "client_tokens_per_minute", wait)

    def charge(self, client: Client, tokens: int, now: float) -> None:
        bucket = self._bucket(client, now)
        if bucket is not None:
            bucket.charge(tokens, now)

    def _bucket(self, client: Client, now: float) -> TokenBucket | None:
        """The bucket for the client's limit in force (a reload may have changed it)."""
        limit = client.tokens_per_minute
        if limit is None:
            self.bucket = None
        elif self.bucket is None or self.bucket.per_minute != limit:
            fresh = TokenBucket(limit, now)
            if self.bucket is not None:  # a new limit keeps the debt, not the old headroom
                self.bucket.empty_for(now)
                fresh.level = min(fresh.level, self.bucket.level)
            self.bucket = fresh
        return self.bucket


def _seconds(value: float) -> int:
    return max(1, math.ceil(value))


def _limited(message: str, code: str, retry_after_s: float) -> TooManyRequests:
    return TooManyRequests(message, code=code, retry_after_s=_seconds(retry_after_s), reason=code)
