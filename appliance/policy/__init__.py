"""Request policy: each rule a small pure function that raises an ApiError or returns a value."""

from __future__ import annotations

from appliance.policy.body import parse_json, validate_chat, validate_completion
from appliance.policy.max_tokens import CLAMP_HEADER, Clamp, clamp_max_tokens, header_value
from appliance.policy.media import (
    MediaPart,
    check_media,
    find_anthropic_media,
    find_batch_media_parts,
    find_media_parts,
    find_responses_media,
)
from appliance.policy.sampling import check_n
from appliance.policy.tools import apply_thinking, check_tools

__all__ = [
    "CLAMP_HEADER",
    "Clamp",
    "MediaPart",
    "apply_thinking",
    "check_media",
    "check_n",
    "check_tools",
    "clamp_max_tokens",
    "find_anthropic_media",
    "find_batch_media_parts",
    "find_media_parts",
    "find_responses_media",
    "header_value",
    "parse_json",
    "validate_chat",
    "validate_completion",
]
