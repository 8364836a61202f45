"""Anthropic's Messages and count_tokens as the gate and the relay serve them, and Anthropic's
error shape and stream ending."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance import policy
from appliance.answers.shape import StreamSoFar, sse_event
from appliance.apis.anthropic.resume import MessagesRecord, plain_message
from appliance.apis.api import ConversationApi, GenerationApi
from appliance.apis.counting import Limits, PromptCounter, chat_bound
from appliance.core.errors import ApiError
from appliance.core.settings import Settings
from appliance.fences.vllm import ANTHROPIC_DEATH, ANTHROPIC_REFUSAL
from appliance.policy import fields, surface
from appliance.policy.tools import apply_template_defaults, tools_active

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


# What changes how an Anthropic conversation is rendered, as count_tokens takes it.
_COUNTED_KEYS = ("model", "messages", "system", "tools", "tool_choice", "thinking",
                 "output_config", "chat_template_kwargs")


class CountTokensApi(GenerationApi):
    """/v1/messages/count_tokens: it renders what /v1/messages would, so it gets the same
    template arguments and media checks; it has no budget."""

    name, path, shape = "count_tokens", "/v1/messages/count_tokens", ANTHROPIC
    fields = fields.CountTokensFields

    def validate(self, body: Mapping[str, Any]) -> None:
        surface.validate_count_tokens(body)

    def media(self, body: Mapping[str, Any]) -> list[policy.MediaPart]:
        return policy.find_anthropic_media(body)  # rendering fetches media as generating does

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """Template defaults under the client's chat_template_kwargs; thinking off with tools
        unless the body chose it."""
        limits = settings.policy
        thinking = body.get("thinking")
        chose_thinking = isinstance(thinking, dict) and thinking.get("type") == "enabled"
        return apply_template_defaults(
            body, limits.default_chat_template_kwargs,
            thinking_off=limits.disable_thinking_with_tools and tools_active(_as_chat(body))
            and not chose_thinking)


class MessagesApi(ConversationApi):
    """/v1/messages: counted by the worker's own /v1/messages/count_tokens."""

    name, path, shape = "messages", "/v1/messages", ANTHROPIC
    fields = fields.MessagesFields
    budget_fields = ("max_tokens",)
    death, refusal = ANTHROPIC_DEATH, ANTHROPIC_REFUSAL

    def diagnosis(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """vLLM's Anthropic stream writes its chat stream's refusal (a 400 error event) as an
        `internal_error` quoting an excerpt of it; not streamed, the refusal is a 400 with its
        reason, before anything is generated."""
        return dict(body) | {"stream": False, self.budget_fields[0]: 1}

    def validate(self, body: Mapping[str, Any]) -> None:
        surface.validate_messages(body)

    def media(self, body: Mapping[str, Any]) -> list[policy.MediaPart]:
        return policy.find_anthropic_media(body)

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """Tools as for chat (in Anthropic's tool_choice vocabulary); its `thinking` is
        vLLM's own; the template arguments count_tokens gets."""
        policy.check_tools(_as_chat(body), tool_parser=settings.engine.tool_call_parser,
                           setting=settings.model_key("tool_call_parser"))
        return COUNT_TOKENS.adjust(body, settings)

    def prompt_bound(self, body: Mapping[str, Any], raw_len: int, limits: Limits,
                     multimodal: bool) -> float:
        messages = body.get("messages")
        turns = (len(messages) if isinstance(messages, list) else 0) + 1  # and the system
        return chat_bound(body, raw_len, limits, turns, multimodal)

    def stream_record(self, body: Mapping[str, Any], settings: Settings, *,
                      media: bool | None = None) -> MessagesRecord | None:
        """A plain text stream (see appliance/apis/anthropic/resume.py)."""
        plain = self.plain_text(body, settings, plain_message, media)
        return MessagesRecord(body) if plain else None

    async def count_prompt(self, body: dict[str, Any], budget: int, limits: Limits,
                           counter: PromptCounter) -> int | None:
        counted = {k: body[k] for k in _COUNTED_KEYS if k in body}
        return await counter.count("/v1/messages/count_tokens", counted, "input_tokens")


def _as_chat(body: dict[str, Any]) -> dict[str, Any]:
    return {"tools": body.get("tools"), "tool_choice": _chat_tool_choice(body)}


def _chat_tool_choice(body: dict[str, Any]) -> Any:
    choice = body.get("tool_choice")
    if not isinstance(choice, dict):
        return None  # vLLM: "auto" whenever tools are given
    kind = choice.get("type")
    return _ANTHROPIC_CHOICES.get(kind, choice) if isinstance(kind, str) else choice


COUNT_TOKENS = CountTokensApi()
MESSAGES = MessagesApi()
