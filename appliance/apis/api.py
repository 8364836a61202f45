"""What every API the gate and the relay serve is described by: one GenerationApi per API.

Each API family has its folder under appliance/apis/ (its API objects, its own rules, its error
shape, its routes); a new route that makes the engine work is one GenerationApi there plus one
handler in its routes module.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import msgspec

from appliance import policy
from appliance.apis.shape import ErrorShape
from appliance.policy import fields
from appliance.settings import Settings

# How a prompt is counted exactly for the budget clamp, each with the worker's own renderer:
# "messages": /tokenize with the chat template; "prompt": /tokenize of raw prompts;
# "conversations": each conversation of a batch as "messages"; "responses": the worker's
# /v1/responses/render; "anthropic": the worker's /v1/messages/count_tokens;
# "none": the route has no completion budget.
PromptKind = Literal["messages", "prompt", "conversations", "responses", "anthropic", "none"]

# An API's own rules beyond the common ones; each returns whether it changed the body, so that
# the gate knows to re-encode it.
ApiRules = Callable[[dict[str, Any], Settings], bool]


@dataclass(frozen=True)
class GenerationApi:
    name: str  # the metric and log label
    path: str  # the worker's route
    validate: Callable[[Mapping[str, Any]], None]
    fields: type[msgspec.Struct]  # the JSON type of every field vLLM reads
    budget_fields: tuple[str, ...]  # the engine obeys the first one present
    prompt: PromptKind
    shape: ErrorShape
    find_media: Callable[[Mapping[str, Any]], list[policy.MediaPart]] | None = None
    rules: ApiRules | None = None  # the API's own rules: tools, thinking, ...
    admitted: bool = True  # takes an admission slot: the engine works for it
    # A stream reports its usage only when `stream_options.include_usage` asks (OpenAI's chat
    # and completions); the other APIs always report it.
    usage_on_request: bool = False


def _no_body(_: Mapping[str, Any]) -> None:
    """A route relayed without a body to check (a GET, a cancel)."""


def relayed(name: str, path: str, shape: ErrorShape) -> GenerationApi:
    """A route the relay forwards as it is: nothing to vet, no budget, no admission slot (the
    engine does no generation work for it)."""
    return GenerationApi(name=name, path=path, validate=_no_body, fields=fields.NoFields,
                         budget_fields=(), prompt="none", shape=shape, admitted=False)
