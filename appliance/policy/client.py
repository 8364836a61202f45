"""A named client's rules on its request body: its max_tokens ceiling, its engine priority, and
the usage event its tokens-per-minute meter needs on a stream."""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence
from typing import Any

from appliance.policy.body import check_count
from appliance.policy.max_tokens import Clamp


def cap_max_tokens(body: MutableMapping[str, Any], fields: Sequence[str], ceiling: int | None,
                   defaulted: bool = False) -> tuple[bool, Clamp | None]:
    """Every budget field above the client's ceiling lowered to it, none given set to it.

    Returns whether the body changed and the clamp of the field the engine obeys (if any).
    """
    if ceiling is None:
        return False, None
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


def set_priority(body: MutableMapping[str, Any], priority: int) -> bool:
    """The client's priority in the body, whatever the client sent (it may not pick its own)."""
    given = body.get("priority")
    if (given is None and priority == 0) or (type(given) is int and given == priority):
        return False  # vLLM's default is 0
    body["priority"] = priority
    return True


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
