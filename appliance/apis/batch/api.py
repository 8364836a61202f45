"""vLLM's chat batch as the gate and the relay serve it."""

from __future__ import annotations

from typing import Any

from appliance import policy
from appliance.apis.api import GenerationApi
from appliance.apis.openai.api import OPENAI, chat_rules
from appliance.policy import fields, surface
from appliance.policy.max_tokens import CHAT_BUDGET
from appliance.settings import Settings


def batch_rules(body: dict[str, Any], settings: Settings) -> bool:
    """A chat batch: one set of parameters for every conversation, so the chat's rules."""
    return chat_rules(body, settings)


BATCH_CHAT = GenerationApi(
    name="chat_batch",
    path="/v1/chat/completions/batch",
    validate=surface.validate_batch_chat,
    fields=fields.BatchChatFields,
    budget_fields=CHAT_BUDGET,
    prompt="conversations",
    shape=OPENAI,
    find_media=policy.find_batch_media_parts,
    rules=batch_rules,
)
