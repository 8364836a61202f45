"""Tool-calling prerequisites and the thinking switch in chat_template_kwargs."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
from typing import Any

from appliance.core.errors import BadRequest

THINKING_TYPES = {"enabled": True, "disabled": False}


def tools_active(body: Mapping[str, Any]) -> bool:
    """True when the request offers tools and does not switch them off with tool_choice "none"."""
    tools = body.get("tools")
    return isinstance(tools, list) and bool(tools) and body.get("tool_choice") != "none"


def check_tools(body: Mapping[str, Any], *, tool_parser: str | None,
                setting: str = "engine.tool_call_parser") -> None:
    """BadRequest when tools need automatic tool-call parsing and no parser is configured.

    Only "auto" (explicit, null, or implied by tools without tool_choice) needs the parser;
    "required" and a named function are served by vLLM with structured output, and "none"
    asks for no tool calls at all.
    """
    if tool_parser or not tools_active(body):
        return
    if body.get("tool_choice", "auto") in ("auto", None):
        raise BadRequest(
            "tool_choice 'auto' needs a tool-call parser and this model has none configured "
            f"(setting {setting}); use tool_choice 'required', a named function, or 'none'.",
            param="tool_choice",
            code="tool_parser_not_configured",
        )


def apply_thinking(
    body: MutableMapping[str, Any],
    *,
    default_kwargs: Mapping[str, Any],
    disable_with_tools: bool,
) -> bool:
    """Set body["chat_template_kwargs"]: defaults under the client's own, thinking resolved.

    The client's chat_template_kwargs win over the configured defaults. A request-level
    `thinking: {"type": "enabled" | "disabled"}` becomes `enable_thinking` and is removed
    (vLLM does not know it). With disable_with_tools, a request with active tools whose client
    did not choose enable_thinking gets enable_thinking False. True when the body changed.
    """
    before = body.get("chat_template_kwargs")
    client = _client_kwargs(body)
    thinking = _pop_thinking(body)
    if thinking is not None:
        if client.get("enable_thinking", thinking) != thinking:
            raise BadRequest(
                "'thinking' and 'chat_template_kwargs.enable_thinking' disagree.",
                param="thinking",
                code="conflicting_thinking",
            )
        client["enable_thinking"] = thinking
    # Copied so that a request's own edits can never reach the configured defaults.
    merged = {**copy.deepcopy(dict(default_kwargs)), **client} if default_kwargs else client
    if disable_with_tools and "enable_thinking" not in client and tools_active(body):
        merged["enable_thinking"] = False
    if merged:
        body["chat_template_kwargs"] = merged
    return thinking is not None or body.get("chat_template_kwargs") != before


def apply_template_defaults(body: MutableMapping[str, Any], default_kwargs: Mapping[str, Any],
                            *, thinking_off: bool) -> bool:
    """chat_template_kwargs: the configured defaults under the client's own, and
    enable_thinking False when `thinking_off` and the client did not choose; True if changed.

    For APIs whose thinking switch is their own (Anthropic `thinking`, Responses `reasoning`),
    which vLLM reads itself: nothing but chat_template_kwargs is touched.
    """
    before = body.get("chat_template_kwargs")
    client = _client_kwargs(body)
    merged = {**copy.deepcopy(dict(default_kwargs)), **client}
    if thinking_off and "enable_thinking" not in client:
        merged["enable_thinking"] = False
    if merged:
        body["chat_template_kwargs"] = merged
    return body.get("chat_template_kwargs") != before


def _client_kwargs(body: Mapping[str, Any]) -> dict[str, Any]:
    value = body.get("chat_template_kwargs")
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise BadRequest(
            "'chat_template_kwargs' must be an object.",
            param="chat_template_kwargs",
            code="invalid_type",
        )
    return dict(value)


def _pop_thinking(body: MutableMapping[str, Any]) -> bool | None:
    """The thinking switch the client asked for, removing the key; None when not asked."""
    value = body.get("thinking")
    if value is None:
        body.pop("thinking", None)
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if not isinstance(kind, str) or kind not in THINKING_TYPES:
        raise BadRequest(
            '\'thinking\' must be an object with "type": "enabled" or "disabled".',
            param="thinking",
            code="invalid_value",
        )
    del body["thinking"]
    return THINKING_TYPES[kind]
