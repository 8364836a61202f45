"""The tokenizer routes as the gate and the relay serve them (in OpenAI's error shape): tokenize
and detokenize through the gate, the tokenizer's description and vLLM's version relayed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from appliance import policy
from appliance.apis.api import GenerationApi, WorkerRoute
from appliance.apis.openai.api import OPENAI
from appliance.core.settings import Settings
from appliance.policy import fields, surface
from appliance.policy.tools import apply_template_defaults


class TokenizeApi(GenerationApi):
    """/tokenize: renders templates and fetches media as generation does; no budget."""

    name, path, shape = "tokenize", "/tokenize", OPENAI
    fields = fields.TokenizeFields

    def validate(self, body: Mapping[str, Any]) -> None:
        surface.validate_tokenize(body)

    def media(self, body: Mapping[str, Any]) -> list[policy.MediaPart]:
        return policy.find_media_parts(body)

    def adjust(self, body: dict[str, Any], settings: Settings) -> bool:
        """Messages are rendered with the template defaults a chat gets, so counts agree."""
        if body.get("messages") is None:
            return False
        return apply_template_defaults(body, settings.policy.default_chat_template_kwargs,
                                       thinking_off=False)


class DetokenizeApi(GenerationApi):
    """/detokenize: token ids back to text; no budget."""

    name, path, shape = "detokenize", "/detokenize", OPENAI
    fields = fields.DetokenizeFields

    def validate(self, body: Mapping[str, Any]) -> None:
        surface.validate_detokenize(body)


TOKENIZE = TokenizeApi()
DETOKENIZE = DetokenizeApi()
TOKENIZER_INFO = WorkerRoute("tokenizer_info", "/tokenizer_info", OPENAI)
VERSION = WorkerRoute("version", "/version", OPENAI)
