"""A named client's rules on its request body: its max_tokens ceiling, no engine priority of its
own, and the usage event its tokens-per-minute meter needs on a stream."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from appliance.policy.body import check_count
from appliance.policy.max_tokens import Clamp

_ABSENT = object()


def cap_max_tokens(body: MutableMapping[str, Any], fields: Sequence[str], ceiling: int | None,
                   defaulted: bool = False) -> tuple[bool, Clamp | None]:
    """Every budget field above the client's ceiling lowered to it, none given set to it.

    Returns whether the body changed and the clamp of the field the engine obeys (if any).
    """
    if ceiling is None or not fields:
        return False, None  # no ceiling, or a route without a completion budget
    given = [field for field in fields if body.get(field) is not None]
    if not given:
        body[fields[0]] = ceiling
        return True, None
    clamps = []
    for field in given:
        requested = body[field]
        check_count(requested, field)
        if requested > ceiling:
            body[field] = ceiling
            clamps.append(Clamp(field=field, requested=requested, applied=ceiling,
                                defaulted=defaulted))
    return bool(clamps), clamps[0] if clamps and clamps[0].field == given[0] else None


def drop_priority(body: MutableMapping[str, Any]) -> bool:
    """Take out a `priority` the client sent: it may not pick its own. The worker gets the
    client's in vLLM's X-Vllm-Priority header, which every generation route of vLLM 0.32 reads
    (Anthropic's too, which has no body field for it). True if the body changed."""
    return body.pop("priority", _ABSENT) is not _ABSENT


def ask_usage(body: MutableMapping[str, Any]) -> bool:
    """Ask a stream for its usage event; True if the request had not (the event is then the
    appliance's, and is taken out of the answer)."""
    if body.get("stream") is not True:
        return False
    options = body.get("stream_options")
    if isinstance(options, dict) and options.get("include_usage") is True:
        return False
    # continuous_usage_stats only counts with include_usage: what the client asked, it keeps.
    kept = {k: v for k, v in (options if isinstance(options, dict) else {}).items()
            if k != "continuous_usage_stats"}
    body["stream_options"] = kept | {"include_usage": True}
    return True
