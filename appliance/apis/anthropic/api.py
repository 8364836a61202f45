"""Anthropic's Messages and count_tokens as the gate and the relay serve them, and Anthropic's
error shape and stream ending."""

from __future__ import annotations

from typing import Any

from appliance import policy
from appliance.apis.api import GenerationApi
from appliance.apis.shape import StreamSoFar, sse_event
from appliance.errors import ApiError
from appliance.policy import fields, surface
from appliance.policy.tools import apply_template_defaults, tools_active
from appliance.settings import Settings

# Anthropic's error types, by the status the appliance answers with.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 529: "overloaded_error",
}
# Anthropic's tool_choice types, in the chat vocabulary vLLM translates them to.
_ANTHROPIC_CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class AnthropicShape:
    """`{"type": "error", "error": {"type", "message"}}`; a stream ends with `event: error`."""

    name = "anthropic"

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        body: dict[str, Any] = {"type": "error", "error": {"type": anthropic_type(error.status),
                                                           "message": error.message}}
        if request_id is not None and error.status == 500:
            body["request_id"] = request_id
        return body

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        return sse_event("error", self.body(error, None))


def anthropic_type(status: int) -> str:
    if status in _ANTHROPIC_TYPES:
        return _ANTHROPIC_TYPES[status]
    return "api_error" if status >= 500 else "invalid_request_error"


ANTHROPIC = AnthropicShape()


def anthropic_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Anthropic Messages: tools as for chat (in Anthropic's tool_choice vocabulary); its
    `thinking` is vLLM's own; template defaults under the client's chat_template_kwargs."""
    policy.check_tools(_as_chat(body), tool_parser=settings.engine.tool_call_parser)
    return anthropic_count_rules(body, settings)


def anthropic_count_rules(body: dict[str, Any], settings: Settings) -> bool:
    """count_tokens renders what /v1/messages would: the same template arguments."""
    limits = settings.policy
    thinking = body.get("thinking")
    chose_thinking = isinstance(thinking, dict) and thinking.get("type") == "enabled"
    return apply_template_defaults(
        body, limits.default_chat_template_kwargs,
        thinking_off=limits.disable_thinking_with_tools and tools_active(_as_chat(body))
        and not chose_thinking)


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    return {"tools": body.get("tools"), "tool_choice": _chat_tool_choice(body)}


def _chat_tool_choice(body: dict[str, Any]) -> Any:
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None  # vLLM: "auto" whenever tools are given
    kind = choice.get("type")
    return _ANTHROPIC_CHOICES.get(kind, choice) if isinstance(kind, str) else choice


MESSAGES = GenerationApi(
    name="messages",
    path="/v1/messages",
    validate=surface.validate_messages,
    fields=fields.MessagesFields,
    budget_fields=("max_tokens",),
    prompt="anthropic",
    shape=ANTHROPIC,
    find_media=policy.find_anthropic_media,
    rules=anthropic_rules,
)

COUNT_TOKENS = GenerationApi(
    name="count_tokens",
    path="/v1/messages/count_tokens",
    validate=surface.validate_count_tokens,
    fields=fields.CountTokensFields,
    budget_fields=(),
    prompt="none",
    shape=ANTHROPIC,
    find_media=policy.find_anthropic_media,  # rendering fetches media as generating does
    rules=anthropic_count_rules,  # the template arguments /v1/messages gets
)
