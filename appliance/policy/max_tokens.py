"""Fit the completion budget into what the context window leaves after the prompt."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from typing import Any

from appliance.errors import BadRequest
from appliance.policy.body import check_count, truncate_prompt_tokens

CLAMP_HEADER = "X-Max-Tokens-Clamped"


@dataclass(frozen=True)
class Clamp:
    """A completion budget lowered to fit: which field, what was asked, what is sent on."""

    field: str
    requested: int
    applied: int
    defaulted: bool = False  # the budget was the configured default, not the client's


def clamp_max_tokens(
    body: MutableMapping[str, Any],
    *,
    prompt_tokens: int,
    max_model_len: int,
    default_max_tokens: int | None,
) -> Clamp | None:
    """Lower max_tokens / max_completion_tokens to the room left, in the body; report it.

    A client budget above the room is clamped, not rejected. With none given the configured
    default is set (clamped the same way); with no default the field stays absent and vLLM
    uses its own. A prompt that leaves no room is a 400 (context_length_exceeded).
    """
    used = effective_prompt_tokens(body, prompt_tokens, max_model_len)
    room = max_model_len - used
    if room < 1:
        raise _context_exceeded(body, max_model_len, used)
    given = [field for field in _budget_fields(body) if body.get(field) is not None]
    if not given:
        return _apply_default(body, default_max_tokens, room)
    clamps = [clamp for field in given if (clamp := _clamp_field(body, field, room))]
    # The first is the one vLLM obeys: max_completion_tokens wins over max_tokens.
    return clamps[0] if clamps else None


def effective_prompt_tokens(body: Mapping[str, Any], prompt_tokens: int, max_model_len: int) -> int:
    """The prompt length the engine will see once truncate_prompt_tokens has applied."""
    limit = truncate_prompt_tokens(body)
    if limit is None:
        return prompt_tokens
    if limit == -1:
        limit = max_model_len
    elif limit > max_model_len:
        raise BadRequest(
            f"'truncate_prompt_tokens' ({limit}) is greater than the model's maximum context "
            f"length ({max_model_len}).",
            param="truncate_prompt_tokens",
            code="invalid_value",
        )
    return min(prompt_tokens, limit)


def header_value(clamp: Clamp) -> str:
    """The clamp as a response header value: `requested=1000000; applied=1843`."""
    value = f"requested={clamp.requested}; applied={clamp.applied}"
    return f"{value}; source=default" if clamp.defaulted else value


def _budget_fields(body: Mapping[str, Any]) -> tuple[str, ...]:
    # Chat takes either name; the completions API knows only max_tokens.
    if "messages" in body:
        return ("max_completion_tokens", "max_tokens")
    return ("max_tokens",)


def _clamp_field(body: MutableMapping[str, Any], field: str, room: int) -> Clamp | None:
    requested = body[field]
    check_count(requested, field)
    if requested <= room:
        return None
    body[field] = room
    return Clamp(field=field, requested=requested, applied=room)


def _apply_default(
    body: MutableMapping[str, Any], default_max_tokens: int | None, room: int
) -> Clamp | None:
    if default_max_tokens is None:
        return None
    field = _budget_fields(body)[0]  # chat's current name, max_completion_tokens
    applied = min(default_max_tokens, room)
    body[field] = applied
    if applied == default_max_tokens:
        return None
    return Clamp(field=field, requested=default_max_tokens, applied=applied, defaulted=True)


def _context_exceeded(
    body: Mapping[str, Any], max_model_len: int, prompt_tokens: int
) -> BadRequest:
    what = "messages" if "messages" in body else "prompt"
    return BadRequest(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"{what} resulted in {prompt_tokens} tokens. Please reduce the length of the {what}.",
        param=what,
        code="context_length_exceeded",
    )
