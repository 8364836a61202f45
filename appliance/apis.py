"""The generation APIs the appliance serves, each described once: what the gate needs to know.

A new generation route is one GenerationApi here (its validator, budget fields, how its prompt
is counted, where its media parts are) plus one handler in appliance/routes/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from appliance import policy
from appliance.policy.fields import ChatFields, CompletionFields
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET
from appliance.shapes import OPENAI, ErrorShape

PromptKind = Literal["messages", "prompt"]


@dataclass(frozen=True)
class GenerationApi:
    name: str  # the metric and log label
    path: str  # the worker's route
    validate: Callable[[Mapping[str, Any]], None]
    fields: type[msgspec.Struct]  # the JSON type of every field vLLM reads
    budget_fields: tuple[str, ...]  # the engine obeys the first one present
    prompt: PromptKind  # how the prompt is counted: a chat template, or raw prompts
    find_media: Callable[[Mapping[str, Any]], list[policy.MediaPart]] | None = None
    chat_rules: bool = False  # tool-parser and thinking rules apply
    shape: ErrorShape = OPENAI


CHAT = GenerationApi(
    name="chat",
    path="/v1/chat/completions",
    validate=policy.validate_chat,
    fields=ChatFields,
    budget_fields=CHAT_BUDGET,
    prompt="messages",
    find_media=policy.find_media_parts,
    chat_rules=True,
)

COMPLETION = GenerationApi(
    name="completion",
    path="/v1/completions",
    validate=policy.validate_completion,
    fields=CompletionFields,
    budget_fields=COMPLETION_BUDGET,
    prompt="prompt",
)
