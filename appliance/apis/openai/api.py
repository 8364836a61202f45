"""OpenAI's chat and completions as the gate and the relay serve them, and OpenAI's error shape."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from appliance import policy
from appliance.answers.shape import StreamSoFar
from appliance.apis.api import ConversationApi, GenerationApi
from appliance.apis.counting import (
    SAFETY_TOKENS,
    TEMPLATE_KEYS,
    Limits,
    PromptCounter,
    chat_bound,
)
from appliance.apis.openai.resume import ChatRecord, CompletionRecord, plain_stream
from appliance.core.errors import ApiError
from appliance.core.settings import Settings
from appliance.fences.vllm import OPENAI_DEATH, TOKEN_EVENT_END, TokenIds
from appliance.policy import fields
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET


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


class ChatApi(ConversationApi):
    """/v1/chat/completions: one conversation; counted by /tokenize with the chat template."""

    name, path, shape = "chat", "/v1/chat/completions", OPENAI
    fields = fields.ChatFields
    budget_fields = CHAT_BUDGET
    usage_on_request = True
    clean_end = TOKEN_EVENT_END
    death = OPENAI_DEATH

    def validate(self, body: Mapping[str, Any]) -> None:
        policy.validate_chat(body)

    def media(self, body: Mapping[str, Any]) -> list[policy.MediaPart]:
        return policy.find_media_parts(body)

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """Tool calls need a parser; the thinking switch and template defaults."""
        limits = settings.policy
        policy.check_tools(body, tool_parser=settings.engine.tool_call_parser,
                           setting=settings.model_key("tool_call_parser"))
        return policy.apply_thinking(body, default_kwargs=limits.default_chat_template_kwargs,
                                     disable_with_tools=limits.disable_thinking_with_tools)

    def prompt_bound(self, body: Mapping[str, Any], raw_len: int, limits: Limits,
                     multimodal: bool) -> float:
        messages = body.get("messages")
        turns = len(messages) if isinstance(messages, list) else 0
        return chat_bound(body, raw_len, limits, turns, multimodal)

    async def count_prompt(self, body: dict[str, Any], budget: int, limits: Limits,
                           counter: PromptCounter) -> int | None:
        return await counter.tokenize({k: body[k] for k in TEMPLATE_KEYS if k in body})

    def stream_record(self, body: Mapping[str, Any], settings: Settings, *,
                      media: bool | None = None) -> ChatRecord | None:
        """A plain text stream (see appliance/apis/openai/resume.py)."""
        if not self.plain_text(body, settings, plain_stream, media):
            return None
        return ChatRecord(body, ids_visible=body.get(TokenIds.REQUEST) is True)


class CompletionApi(GenerationApi):
    """/v1/completions: a raw prompt, a list of them, or token ids; counted by /tokenize."""

    name, path, shape = "completion", "/v1/completions", OPENAI
    fields = fields.CompletionFields
    budget_fields = COMPLETION_BUDGET
    usage_on_request = True
    clean_end = TOKEN_EVENT_END
    death = OPENAI_DEATH

    def validate(self, body: Mapping[str, Any]) -> None:
        policy.validate_completion(body)

    def prompt_bound(self, body: Mapping[str, Any], raw_len: int, limits: Limits,
                     multimodal: bool) -> float:
        prompts = body.get("prompt")
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], list):
            return max(len(p) for p in prompts)  # token ids: exact already
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], int):
            return len(prompts)
        return limits.prompt_base + raw_len + SAFETY_TOKENS

    def one_prompt(self, body: Mapping[str, Any]) -> bool:
        return isinstance(body.get("prompt"), str)

    def stream_record(self, body: Mapping[str, Any], settings: Settings, *,
                      media: bool | None = None) -> CompletionRecord | None:
        """A plain stream of one prompt (text, or token ids): see appliance/apis/openai/resume.py."""
        prompt = body.get("prompt")
        single = isinstance(prompt, str) or (
            isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], int))
        if not single or not plain_stream(body):
            return None
        return CompletionRecord(body, ids_visible=body.get(TokenIds.REQUEST) is True)

    async def count_prompt(self, body: dict[str, Any], budget: int, limits: Limits,
                           counter: PromptCounter) -> int | None:
        """The longest prompt: each text that might not fit is counted, token ids are exact."""
        prompts = body.get("prompt")
        items = prompts if isinstance(prompts, list) and prompts and not isinstance(
            prompts[0], int) else [prompts]
        uncounted = [p for p in items if isinstance(p, str) and budget + limits.prompt_base
                     + len(p.encode()) + SAFETY_TOKENS > limits.window]
        counter.check_counted(len(uncounted), "prompt", "prompts")
        longest = 0
        for item in items:
            if isinstance(item, list):
                longest = max(longest, len(item))
            elif isinstance(item, str):
                size = (await counter.tokenize({"prompt": item}) if item in uncounted
                        else limits.prompt_base + len(item.encode()))
                if size is None:
                    return None
                longest = max(longest, size)
        return longest


CHAT = ChatApi()
COMPLETION = CompletionApi()
