"""OpenAI's chat and completions as the gate and the relay serve them, and OpenAI's error shape."""

from __future__ import annotations

from typing import Any

import msgspec

from appliance import policy
from appliance.apis.api import GenerationApi
from appliance.apis.shape import StreamSoFar
from appliance.errors import ApiError
from appliance.policy import fields
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET
from appliance.settings import Settings


class OpenAIShape:
    """`{"error": {"message", "type", "param", "code"}}`; a stream ends `data: {error}` + [DONE]."""

    name = "openai"

    def body(self, error: ApiError, request_id: str | None) -> dict[str, Any]:
        detail: dict[str, Any] = {"message": error.message, "type": error.kind,
                                  "param": error.param, "code": error.code}
        if request_id is not None and error.status == 500:
            detail["request_id"] = request_id  # what an operator greps the log for
        return {"error": detail}

    def stream_end(self, error: ApiError, so_far: StreamSoFar) -> bytes:
        return b"data: " + msgspec.json.encode(self.body(error, None)) + b"\n\ndata: [DONE]\n\n"


OPENAI = OpenAIShape()


def chat_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Chat: tool calls need a parser; the thinking switch and template defaults."""
    limits = settings.policy
    policy.check_tools(body, tool_parser=settings.engine.tool_call_parser)
    return policy.apply_thinking(body, default_kwargs=limits.default_chat_template_kwargs,
                                 disable_with_tools=limits.disable_thinking_with_tools)


CHAT = GenerationApi(
    name="chat",
    path="/v1/chat/completions",
    validate=policy.validate_chat,
    fields=fields.ChatFields,
    budget_fields=CHAT_BUDGET,
    prompt="messages",
    shape=OPENAI,
    find_media=policy.find_media_parts,
    rules=chat_rules,
    usage_on_request=True,
)

COMPLETION = GenerationApi(
    name="completion",
    path="/v1/completions",
    validate=policy.validate_completion,
    fields=fields.CompletionFields,
    budget_fields=COMPLETION_BUDGET,
    prompt="prompt",
    shape=OPENAI,
    usage_on_request=True,
)
