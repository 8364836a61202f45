"""The APIs the appliance serves through the gate and the relay, each described once.

A new route that makes the engine work is one GenerationApi here (its validator, field types,
budget fields, how its prompt is counted, where its media parts are, its own rules, its error
shape) plus one handler in appliance/routes/.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from appliance import policy, rules
from appliance.policy import fields, surface
from appliance.policy.max_tokens import CHAT_BUDGET, COMPLETION_BUDGET
from appliance.shapes import ANTHROPIC, OPENAI, RESPONSES, ErrorShape

# How a prompt is counted exactly for the budget clamp, each with the worker's own renderer:
# "messages": /tokenize with the chat template; "prompt": /tokenize of raw prompts;
# "conversations": each conversation of a batch as "messages"; "responses": the worker's
# /v1/responses/render; "anthropic": the worker's /v1/messages/count_tokens;
# "none": the route has no completion budget.
PromptKind = Literal["messages", "prompt", "conversations", "responses", "anthropic", "none"]


@dataclass(frozen=True)
class GenerationApi:
    name: str  # the metric and log label
    path: str  # the worker's route
    validate: Callable[[Mapping[str, Any]], None]
    fields: type[msgspec.Struct]  # the JSON type of every field vLLM reads
    budget_fields: tuple[str, ...]  # the engine obeys the first one present
    prompt: PromptKind
    find_media: Callable[[Mapping[str, Any]], list[policy.MediaPart]] | None = None
    rules: rules.ApiRules | None = None  # the API's own rules: tools, thinking, ...
    shape: ErrorShape = OPENAI
    admitted: bool = True  # takes an admission slot: the engine works for it
    # A stream reports its usage only when `stream_options.include_usage` asks (OpenAI's chat
    # and completions); the other APIs always report it.
    usage_on_request: bool = False


CHAT = GenerationApi(
    name="chat",
    path="/v1/chat/completions",
    validate=policy.validate_chat,
    fields=fields.ChatFields,
    budget_fields=CHAT_BUDGET,
    prompt="messages",
    find_media=policy.find_media_parts,
    rules=rules.chat_rules,
    usage_on_request=True,
)

COMPLETION = GenerationApi(
    name="completion",
    path="/v1/completions",
    validate=policy.validate_completion,
    fields=fields.CompletionFields,
    budget_fields=COMPLETION_BUDGET,
    prompt="prompt",
    usage_on_request=True,
)

BATCH_CHAT = GenerationApi(
    name="chat_batch",
    path="/v1/chat/completions/batch",
    validate=surface.validate_batch_chat,
    fields=fields.BatchChatFields,
    budget_fields=CHAT_BUDGET,
    prompt="conversations",
    find_media=policy.find_batch_media_parts,
    rules=rules.batch_rules,
)

RESPONSES_CREATE = GenerationApi(
    name="responses",
    path="/v1/responses",
    validate=surface.validate_responses,
    fields=fields.ResponsesFields,
    budget_fields=("max_output_tokens",),
    prompt="responses",
    find_media=policy.find_responses_media,
    rules=rules.responses_rules,
    shape=RESPONSES,
)

MESSAGES = GenerationApi(
    name="messages",
    path="/v1/messages",
    validate=surface.validate_messages,
    fields=fields.MessagesFields,
    budget_fields=("max_tokens",),
    prompt="anthropic",
    find_media=policy.find_anthropic_media,
    rules=rules.anthropic_rules,
    shape=ANTHROPIC,
)

COUNT_TOKENS = GenerationApi(
    name="count_tokens",
    path="/v1/messages/count_tokens",
    validate=surface.validate_count_tokens,
    fields=fields.CountTokensFields,
    budget_fields=(),
    prompt="none",
    find_media=policy.find_anthropic_media,  # rendering fetches media as generating does
    rules=rules.anthropic_count_rules,  # the template arguments /v1/messages gets
    shape=ANTHROPIC,
)

TOKENIZE = GenerationApi(
    name="tokenize",
    path="/tokenize",
    validate=surface.validate_tokenize,
    fields=fields.TokenizeFields,
    budget_fields=(),
    prompt="none",
    find_media=policy.find_media_parts,
    rules=rules.tokenize_rules,
)

DETOKENIZE = GenerationApi(
    name="detokenize",
    path="/detokenize",
    validate=surface.validate_detokenize,
    fields=fields.DetokenizeFields,
    budget_fields=(),
    prompt="none",
)


def _no_body(_: Mapping[str, Any]) -> None:
    """A route relayed without a body to check (a GET, a cancel)."""


def _relayed(name: str, path: str, shape: ErrorShape = OPENAI) -> GenerationApi:
    """A route the relay forwards as it is: nothing to vet, no budget, no admission slot (the
    engine does no generation work for it)."""
    return GenerationApi(name=name, path=path, validate=_no_body, fields=fields.NoFields,
                         budget_fields=(), prompt="none", shape=shape, admitted=False)


RESPONSES_RETRIEVE = _relayed("responses_retrieve", "/v1/responses/{id}", RESPONSES)
RESPONSES_CANCEL = _relayed("responses_cancel", "/v1/responses/{id}/cancel", RESPONSES)
TOKENIZER_INFO = _relayed("tokenizer_info", "/tokenizer_info")
VERSION = _relayed("version", "/version")
