"""vLLM's chat batch as the gate and the relay serve it: many conversations, one set of
parameters, each conversation counted as a chat's messages."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec

from appliance import policy
from appliance.apis.api import GenerationApi
from appliance.apis.counting import (
    TEMPLATE_KEYS,
    Limits,
    PromptCounter,
    chat_bound,
    rendered_bound,
)
from appliance.apis.openai.api import CHAT, OPENAI
from appliance.core.sections import PolicySettings
from appliance.core.settings import Settings
from appliance.policy import fanout, fields, surface
from appliance.policy.fanout import check_conversations
from appliance.policy.max_tokens import CHAT_BUDGET


class BatchChatApi(GenerationApi):
    """/v1/chat/completions/batch."""

    name, path, shape = "chat_batch", "/v1/chat/completions/batch", OPENAI
    fields = fields.BatchChatFields
    budget_fields = CHAT_BUDGET

    def validate(self, body: Mapping[str, Any]) -> None:
        surface.validate_batch_chat(body)

    def check_size(self, body: Mapping[str, Any], limits: PolicySettings) -> None:
        check_conversations(body, limits.max_batch_prompts)

    def sequences(self, body: Mapping[str, Any]) -> tuple[int, str]:
        """Each conversation is a sequence, `n` times."""
        conversations = body.get("messages")
        count = len(conversations) if isinstance(conversations, list) else 1
        return fanout.sequences(count, body), "messages" if count > 1 else "n"

    def media(self, body: Mapping[str, Any]) -> list[policy.MediaPart]:
        return policy.find_batch_media_parts(body)

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """One set of parameters for every conversation, so the chat's rules."""
        return CHAT.adjust(body, settings)

    def prompt_bound(self, body: Mapping[str, Any], raw_len: int, limits: Limits,
                     multimodal: bool) -> float:
        turns = max((len(c) for c in body.get("messages") or [] if isinstance(c, list)),
                    default=0)
        return chat_bound(body, raw_len, limits, turns, multimodal)

    def one_prompt(self, body: Mapping[str, Any]) -> bool:
        return False  # the count is the longest conversation's

    async def count_prompt(self, body: dict[str, Any], budget: int, limits: Limits,
                           counter: PromptCounter) -> int | None:
        """The longest conversation: each one that might not fit is counted as chat messages."""
        shared = {k: body[k] for k in TEMPLATE_KEYS if k in body and k != "messages"}
        bounds = [(conversation, rendered_bound(shared, len(msgspec.json.encode(conversation)),
                                                limits, len(conversation)))
                  for conversation in body.get("messages") or []]
        uncounted = [c for c, bound in bounds if budget + bound > limits.window]
        counter.check_counted(len(uncounted), "messages", "conversations")
        longest = max((int(bound) for c, bound in bounds if budget + bound <= limits.window),
                      default=0)
        for conversation in uncounted:
            size = await counter.tokenize(shared | {"messages": conversation})
            if size is None:
                return None
            longest = max(longest, size)
        return longest


BATCH_CHAT = BatchChatApi()
