"""The tokenizer routes as the gate and the relay serve them (in OpenAI's error shape)."""

from __future__ import annotations

from typing import Any

from appliance import policy
from appliance.apis.api import GenerationApi, relayed
from appliance.apis.openai.api import OPENAI
from appliance.policy import fields, surface
from appliance.policy.tools import apply_template_defaults
from appliance.settings import Settings


def tokenize_rules(body: dict[str, Any], settings: Settings) -> bool:
    """Messages are rendered with the template defaults a chat gets, so counts agree."""
    if body.get("messages") is None:
        return False
    return apply_template_defaults(body, settings.policy.default_chat_template_kwargs,
                                   thinking_off=False)


TOKENIZE = GenerationApi(
    name="tokenize",
    path="/tokenize",
    validate=surface.validate_tokenize,
    fields=fields.TokenizeFields,
    budget_fields=(),
    prompt="none",
    shape=OPENAI,
    find_media=policy.find_media_parts,
    rules=tokenize_rules,
)

DETOKENIZE = GenerationApi(
    name="detokenize",
    path="/detokenize",
    validate=surface.validate_detokenize,
    fields=fields.DetokenizeFields,
    budget_fields=(),
    prompt="none",
    shape=OPENAI,
)

TOKENIZER_INFO = relayed("tokenizer_info", "/tokenizer_info", OPENAI)
VERSION = relayed("version", "/version", OPENAI)
